"""The app's screens (one per mode): chat, dashboard, models; plus small modal dialogs."""
