"""The torch backend's decode path through static buffers (backends/torch/graphs.py).

On a GPU that path is recorded once per bucket as a CUDA graph and replayed; on torch's CPU
device (the default here) the same padded static forward runs eagerly (`TorchOps(graphs=True)`),
so every part but the record and the replay is checked: padding rows to a power of two and blocks to a
bucket, the device-side rope angles and attention mask, the scratch block that padded rows
write into. Against the ordinary eager path: the same logits (float32) and the same greedy
text, and the real sequences' K/V untouched by the padding.
`EDGEINFER_TEST_TORCH_DEVICE=cuda` runs it on a GPU, where the graphs are recorded and replayed.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgeinfer.backends.torch.graphs import DecodeGraphs, bucket  # noqa: E402
from edgeinfer.runners.base import ScheduledSpan  # noqa: E402
from edgeinfer.runners.native import ModelRunner  # noqa: E402

torch.set_num_threads(2)
DEVICE = os.environ.get("EDGEINFER_TEST_TORCH_DEVICE", "cpu")
SYNTH = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth"


def _runner(path: str, graphs: bool) -> ModelRunner:
    r = ModelRunner.load(path, f"torch:{DEVICE}", kv_budget_bytes=8 << 20, torch_dtype="float32")
    r.ops.graphs = graphs
    r._decode = r.ops.decode_graphs(r.model, r.kv)
    return r


def _span(rid: int, start: int, tokens, table) -> ScheduledSpan:
    return ScheduledSpan(rid, start, tuple(int(t) for t in tokens),
                         tuple(int(b) for b in table), True)


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_static_decode_equals_eager(arch):
    """Three sequences (a bucket of 4 rows: one padding row) prefill 40 tokens each, then
    decode 30 steps together: their positions cross from 4 to 8 gathered blocks, past
    gemma3's 32-token window. Block 0 is in a real table, where a padding row that missed
    the scratch block would write."""
    from synth import synthetic_model
    path = str(synthetic_model(SYNTH, arch, "F32"))
    eager, static = _runner(path, False), _runner(path, True)
    assert eager._decode is None and isinstance(static._decode, DecodeGraphs)
    assert static._decode.capture == (DEVICE == "cuda")
    taken = []
    run = static._decode.run
    static._decode.run = lambda b: taken.append(run(b)) or taken[-1]
    rng = np.random.default_rng(3)
    blocks = rng.permutation(eager.kv_plan.num_blocks)[:15]
    blocks[0] = 0
    tables = [blocks[i * 5:(i + 1) * 5] for i in range(3)]
    prompts = [rng.integers(3, 250, 40) for _ in range(3)]
    # lockstep, teacher-forced by the eager path's tokens: a near tie that rounds the other
    # way (cuBLAS may pick another kernel for 4 rows than for 3) stays one row, not a new text
    for r in (eager, static):
        for i in range(3):
            r.forward([_span(i, 0, prompts[i], tables[i])])
    nxt = [int(p[-1]) for p in prompts]
    out = {"eager": [], "static": []}
    for step in range(30):
        for name, r in (("eager", eager), ("static", static)):
            out[name].append(r.forward([_span(i, 40 + step, [nxt[i]], tables[i])
                                        for i in range(3)]))
        nxt = [int(t) for t in out["eager"][-1].argmax(1)]
    assert len(taken) == 30 and all(t is not None for t in taken)
    if DEVICE == "cuda":    # 30 steps in buckets (4 rows, 4 blocks) and (4, 8): two records
        assert sorted(static._decode._graphs) == [(4, 4), (4, 8)]
    a, b = np.stack(out["eager"]), np.stack(out["static"])
    assert np.abs(a - b).max() <= (1e-4 if DEVICE == "cpu" else 1e-3) * np.abs(a).max()
    # on the CPU every row's top token agrees; on a GPU (float32, cuBLAS's kernels chosen by
    # the row count) a near tie may not
    agree = (a.argmax(-1) == b.argmax(-1)).mean()
    assert agree == 1.0 if DEVICE == "cpu" else agree >= 0.95
    # padding rows wrote into the scratch block, and nothing else the tables name changed
    scratch = static.kv.scratch_block
    assert scratch == static.kv_plan.num_blocks
    assert float(static.kv.k[0][scratch].abs().sum()) > 0
    for layer in (0, len(static.kv.k) - 1):
        for cache in ("k", "v"):
            x = getattr(eager.kv, cache)[layer][blocks].float()
            y = getattr(static.kv, cache)[layer][blocks].float()
            assert torch.allclose(x, y, rtol=1e-3, atol=1e-3)


def test_mixed_steps_and_large_contexts_run_eagerly():
    """Only pure decode steps take the static path: a step with a prefill chunk, or one
    whose context needs more blocks than the pool's bucket, runs as before."""
    from synth import synthetic_model
    r = _runner(str(synthetic_model(SYNTH, "llama", "F32")), True)
    d = r._decode
    table = list(range(5))
    from edgeinfer.runners.native import build_forward_batch
    mixed = build_forward_batch([_span(0, 0, [5, 6, 7], table), _span(1, 4, [9], table)],
                                r.kv_plan.block_size)
    assert not d.applies(mixed)
    one = build_forward_batch([_span(0, 4, [9], table)], r.kv_plan.block_size)
    assert d.applies(one)
    one.positions[:] = (d.max_blocks + 1) * r.kv_plan.block_size
    assert d.run(one) is None


def test_graph_safe_is_not_inherited_by_a_forward_of_its_own():
    from edgeinfer.models.llama import LlamaModel
    from edgeinfer.runners.native import _forward_owner_says

    class Own(LlamaModel):
        def forward(self, batch, kv):
            return super().forward(batch, kv)

    assert _forward_owner_says(object.__new__(LlamaModel), "graph_safe")
    assert not _forward_owner_says(object.__new__(Own), "graph_safe")


def test_a_failed_record_falls_back_to_op_by_op(caplog):
    """Recording on a device that cannot (here: torch's CPU device, which has no CUDA
    streams) logs once, runs that step and every later one op by op, with the same logits."""
    from synth import synthetic_model
    path = str(synthetic_model(SYNTH, "llama", "F32"))
    eager, r = _runner(path, False), _runner(path, True)
    r._decode.capture = True
    if DEVICE == "cuda":        # a recording that fails on a real GPU
        r._decode._pool = "not a pool"
    table = list(range(4))
    for x in (eager, r):
        x.forward([_span(0, 0, list(range(5, 25)), table)])
    with caplog.at_level("WARNING"):
        a = [eager.forward([_span(0, 20 + i, [7 + i], table)]) for i in range(3)]
        b = [r.forward([_span(0, 20 + i, [7 + i], table)]) for i in range(3)]
    assert r._decode.disabled and not r._decode._graphs
    assert sum("CUDA graph recording failed" in m for m in caplog.messages) == 1
    # (on a GPU the first step's logits are the padded warm-up's: equal up to rounding)
    assert all(np.abs(x - y).max() <= 1e-4 * np.abs(x).max() for x, y in zip(a, b))
    assert [int(x.argmax()) for x in a] == [int(y.argmax()) for y in b]


def test_close_lets_go_of_the_model():
    from synth import synthetic_model
    r = _runner(str(synthetic_model(SYNTH, "llama", "F32")), True)
    d = r._decode
    r.close()
    assert r._decode is None and d.model is None and d.kv is None and d.disabled
