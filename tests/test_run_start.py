"""What `edgeinfer run --no-daemon` does before its first token (benchmarks/cold_start.py
times it): one parse of the file's header and vocabulary, no torch where the machine shows
no GPU, and Python's collector held off while the model loads, then frozen
(edgeinfer/startup_gc.py) in the command's own process only."""
from __future__ import annotations

import json
import subprocess
import sys

from edgeinfer.backends.torch.device import gpu_absent

# the command line's process, as the console script runs it (main() with no argv), with the
# GGUF parses counted
_RUN = r"""
import gc, json, sys
from edgeinfer.formats import gguf_file
parses = []
_parse = gguf_file._parse
def counted(path, *a, **k):
    parses.append(path)
    return _parse(path, *a, **k)
gguf_file._parse = counted
from edgeinfer.cli.main import main
sys.argv = ["edgeinfer", "run", "--no-daemon", "--raw", "--temperature", "0",
            "--max-tokens", "2", sys.argv[1], "Hello"]
rc = main()
print(json.dumps({"rc": rc, "parses": len(parses), "torch": "torch" in sys.modules,
                  "gc_on": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_run_in_process_parses_once_and_holds_the_collector_while_loading(smollm2_path):
    p = subprocess.run([sys.executable, "-c", _RUN, str(smollm2_path)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    assert facts["rc"] == 0, p.stderr[-3000:]
    # the backend choice, the kernel steps and the runner share one parse of the vocabulary
    assert facts["parses"] == 1
    # collection back on after the load, with what the load left frozen
    assert facts["gc_on"] and facts["frozen"] > 10_000
    if gpu_absent("cuda") and gpu_absent("mps"):
        assert not facts["torch"], "--backend auto imported torch on a machine with no GPU"


_LIBRARY = r"""
import gc, json
from edgeinfer import startup_gc
startup_gc.release()                    # no hold: nothing happens
a = (gc.isenabled(), gc.get_freeze_count())
gc.disable()
startup_gc.hold(); startup_gc.release()  # the user's own choice (off) stays
b = (gc.isenabled(), gc.get_freeze_count())
gc.enable()
startup_gc.hold()
c = gc.isenabled()
startup_gc.release()
d = (gc.isenabled(), gc.get_freeze_count() > 0)
print(json.dumps([a, b, c, d]))
"""


def test_the_collector_is_only_frozen_where_an_entry_point_held_it():
    out = subprocess.run([sys.executable, "-c", _LIBRARY], capture_output=True, text=True,
                         check=True).stdout
    a, b, c, d = json.loads(out)
    assert a == [True, 0]
    assert b == [False, 0]
    assert c is False
    assert d == [True, True]
