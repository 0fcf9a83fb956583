"""`python -m edgeinfer ...`: the same as the `edgeinfer` command (the daemon starts this way)."""
import sys

from edgeinfer.cli.main import main

sys.exit(main())
