"""`python -m edgeinfer.tui`: the same as `edgeinfer tui`."""
import sys

from .app import run

sys.exit(run())
