"""The C heap's policies (edgeinfer/engine/heap.py), each in a fresh process (they are
process-wide): an engine's keeps a step's large temporaries in the heap, so the next step's
blocks of the same size fault in no pages; the daemon's pinned thresholds map every large
block on its own and win over a later engine's request."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's mallopt and /proc page-fault counts")

# 20 steps, each allocating and touching the 1.5B model's FFN activations at 512 rows (two
# float32[512, 8960] blocks, 18 MB each) and freeing them: minor page faults per step
_STEPS = """
import json, resource, sys
import numpy as np
from edgeinfer.engine import heap
applied = None
for call in sys.argv[1:]:
    r = getattr(heap, call)()
    if call == "recycle_large_blocks":
        applied = r
def step():
    a = np.empty((512, 8960), np.float32); a[:] = 1
    b = np.empty((512, 8960), np.float32); b[:] = 2
    return float(a[-1, -1] + b[-1, -1])
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20
print(json.dumps({"applied": applied, "faults": faults}))
"""
_PAGES = 2 * 512 * 8960 * 4 // 4096     # 4 KiB pages of one step's two blocks


def _run(*calls: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _STEPS, *calls], capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engines_heap_reuses_the_last_steps_pages():
    r = _run("recycle_large_blocks")
    assert r["applied"] is True
    assert r["faults"] < 0.02 * _PAGES, r


def test_the_daemons_pinned_thresholds_map_large_blocks_and_win_over_an_engine():
    r = _run("pin_mmap_threshold", "recycle_large_blocks")
    assert r["applied"] is False
    # every step maps its blocks afresh: at least one fault per transparent huge page
    # (numpy asks for them on large arrays), and one per 4 KiB page without them
    assert r["faults"] >= _PAGES // 512, r
    assert r["faults"] > 10 * _run("recycle_large_blocks")["faults"] + 5

