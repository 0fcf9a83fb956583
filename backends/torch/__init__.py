"""The torch backend (cuda, mps, cpu). Importing this package does not import torch;
`device.choose_backend` works without it."""
