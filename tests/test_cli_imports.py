"""Every `edgeinfer` command starts by importing the CLI: the GGUF reader's numpy and gguf,
the kernels' numba, torch, the terminal app, httpx (the daemon client is http.client's) and
rich (pull's progress bars) stay out of that (the command that needs them imports them), so
a command that only talks to the daemon starts in a tenth of a second."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "gguf", "numba", "torch", "textual", "edgeinfer.formats.gguf_file", "httpx",
         "rich", "edgeinfer.store.pull")


def test_the_cli_imports_no_heavy_module():
    code = ("import sys, edgeinfer.cli.main, edgeinfer.runners.sampling_params;"
            "print(','.join(m for m in %r if m in sys.modules))" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"imported at CLI start: {out}"
