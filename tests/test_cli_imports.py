"""Every `edgeinfer` command starts by importing the CLI: the GGUF reader's numpy and gguf,
the kernels' numba, torch, the terminal app, httpx (the daemon client is http.client's) and
rich (pull's progress bars) stay out of that (the command that needs them imports them), so
a command that only talks to the daemon starts in a tenth of a second."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "gguf", "numba", "torch", "textual", "edgeinfer.formats.gguf_file", "httpx",
         "rich", "edgeinfer.store.pull")


def _last_line(code: str) -> str:
    """What a fresh interpreter running `code` prints last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    return out[-1] if out else ""


def test_the_cli_imports_no_heavy_module():
    code = ("import sys, edgeinfer.cli.main, edgeinfer.runners.sampling_params;"
            "print(','.join(m for m in %r if m in sys.modules))" % (HEAVY,))
    out = _last_line(code)
    assert out == "", f"imported at CLI start: {out}"


def test_the_daemon_runs_without_numba():
    """The daemon's modules and its numba-free answers (/api/show's runtime through
    backends/cpu_plan.py, the thread governor) leave numba, ~65 MB, to the engine processes;
    and cpu_plan's host ISA and tile height are the kernels' own."""
    code = (
        "import sys, json, uvicorn, edgeinfer.server.app\n"
        "from edgeinfer.server.model_manager import ModelManager, ServerConfig\n"
        "from edgeinfer.backends import cpu_plan\n"
        "ModelManager(ServerConfig.from_env())\n"
        "isa = cpu_plan.best_isa()\n"
        "before = 'numba' in sys.modules\n"
        "from edgeinfer.backends.cpu import _int8\n"
        "print(json.dumps([before, isa == _int8.BEST_ISA, cpu_plan.LANES == _int8.LANES]))")
    assert _last_line(code) == "[false, true, true]"


def test_an_engine_loads_jinja_only_to_render():
    """Chat templates' Jinja side (edgeinfer/formats/chat_sandbox.py, ~15 ms of imports)
    loads with the first compile or render: an engine process, which renders none, and a raw
    completion never load it; the first render does, and gives the template's text."""
    code = (
        "import sys\n"
        "import edgeinfer.engine.core, edgeinfer.engine.remote\n"
        "from edgeinfer.formats import chat_template\n"
        "before = 'jinja2' in sys.modules\n"
        "text = chat_template.render_chat(chat_template.builtin_template('chatml'),\n"
        "                                 [{'role': 'user', 'content': 'hi'}])\n"
        "print(before, 'jinja2' in sys.modules, text.replace(chr(10), '|'))")
    out = _last_line(code)
    assert out.startswith("False True "), out
    assert out.endswith("<|im_start|>user|hi<|im_end|>|<|im_start|>assistant|"), out
