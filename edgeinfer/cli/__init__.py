"""Command line: each subcommand in its own module, registered by main.py."""
