"""The torch backend against the numba CPU backend, llama.cpp, and a dense attention
reference: same logits, same greedy text, batch invariance, prefix reuse, sliding window, paged
attention through random block tables and chunked queries.

It runs on torch's CPU device unless EDGEINFER_TEST_TORCH_DEVICE names another (`cuda`, `mps`):
`EDGEINFER_TEST_TORCH_DEVICE=cuda pytest tests/test_torch_backend.py` checks a GPU. The parity
tests load the torch side in float32 there too (the GPUs' default is bf16, whose rounding the
tight comparisons with numba's float32 would not survive); test_bf16_weights_opt_in covers
the 16-bit default on that device."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgeinfer.backends.base import ForwardBatch  # noqa: E402
from edgeinfer.backends.torch.attention import StepLayout, paged_attention, write_kv  # noqa: E402
from edgeinfer.backends.torch.device import (InsufficientMemory, check_fits,  # noqa: E402
                                             detect)
from edgeinfer.engine.core import Engine, EngineConfig, greedy  # noqa: E402
from edgeinfer.runners.base import ScheduledSpan  # noqa: E402
from edgeinfer.runners.choice import resolve  # noqa: E402
from edgeinfer.runners.native import ModelRunner  # noqa: E402

torch.set_num_threads(2)

DEVICE = os.environ.get("EDGEINFER_TEST_TORCH_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda", "mps"):
    raise pytest.UsageError(f"EDGEINFER_TEST_TORCH_DEVICE={DEVICE!r}: use cpu, cuda or mps")
if DEVICE != "cpu" and detect().kind != DEVICE:
    pytest.skip(f"EDGEINFER_TEST_TORCH_DEVICE={DEVICE} but torch sees no {DEVICE} device here",
                allow_module_level=True)
BACKEND = f"torch:{DEVICE}"     # never plain "torch": that picks a GPU whenever one is there
F32 = "float32"                 # the parity tests' torch dtype on any device (module doc)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]


class _Seq:
    def __init__(self, block_table):
        self.block_table = block_table


def _Chunk(seq, start, token_ids, needs_logits=True) -> ScheduledSpan:
    return ScheduledSpan(0, start, tuple(int(t) for t in token_ids),
                         tuple(int(b) for b in seq.block_table), needs_logits)


def exact_cpu(runner):
    """Put a numba-CPU runner in plain float32 numerics (no llama.cpp-style 8-bit activation
    rounding), the same math as the torch backend, so the two can be compared closely."""
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.models import build_model
    runner.ops = CpuOps(numerics="f32")
    runner.model = build_model(runner.cfg, runner.ops, runner.gf)   # float weights' layout
    plan, cfg = runner.kv_plan, runner.cfg                          # and a float32 KV pool
    runner.kv = runner.ops.new_kv_cache(cfg.n_layers, plan.num_blocks, plan.block_size,
                                        cfg.n_kv_head, cfg.head_dim)
    return runner


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Submit all prompts at once and step until every one finished; outputs in input order."""
    events: dict[int, list[int]] = {}
    ids = []
    for p in prompts:
        rid = engine.submit(p, greedy(max_tokens), lambda o: events.setdefault(o.request_id, []).extend(o.token_ids))
        ids.append(rid)
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    return [events.get(r, []) for r in ids]


# -- attention through block tables vs a dense reference --------------------------------------
def dense_reference(q, k_all, v_all, pos, window, scale):
    """One query token at `pos` over its sequence's dense K/V [P, KVH, D]."""
    H, D = q.shape
    group = H // k_all.shape[1]
    lo = max(0, pos - window + 1) if window > 0 else 0
    out = np.empty_like(q)
    for h in range(H):
        k = k_all[lo:pos + 1, h // group]
        v = v_all[lo:pos + 1, h // group]
        s = (k @ q[h]) * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [0, 7, 20])
def test_paged_attention_matches_dense(seed, window):
    rng = np.random.default_rng(seed)
    bs, kvh, H, D, nblocks = 4, 2, 4, 8, 64
    S = int(rng.integers(1, 5))
    dev = torch.device(DEVICE)
    kc = torch.zeros(nblocks, bs, kvh, D, device=dev)
    vc = torch.zeros(nblocks, bs, kvh, D, device=dev)
    on = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    free = list(rng.permutation(nblocks))
    seqs = []
    for _ in range(S):
        cached = int(rng.integers(0, 30))
        chunk = int(rng.integers(1, 12)) if rng.random() < 0.6 else 1   # prefill chunk or decode
        total = cached + chunk
        table = [int(free.pop()) for _ in range((total + bs - 1) // bs)]
        k_all = rng.standard_normal((total, kvh, D)).astype(np.float32)
        v_all = rng.standard_normal((total, kvh, D)).astype(np.float32)
        # the earlier steps' K/V already sit in the cache
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached)], dtype=torch.int64,
                             device=dev)
        if cached:
            write_kv(kc, vc, on(k_all[:cached]), on(v_all[:cached]), slots)
        seqs.append((cached, chunk, table, k_all, v_all))
    order = list(rng.permutation(S))   # sequences appear in the batch in any order
    tok, pos, seq_of, slot = [], [], [], []
    width = max(len(s[2]) for s in seqs) + int(rng.integers(0, 3))
    tables = np.zeros((S, width), np.int32)
    q_rows, k_rows, v_rows = [], [], []
    for row, i in enumerate(order):
        cached, chunk, table, k_all, v_all = seqs[i]
        tables[row, :len(table)] = table
        for p in range(cached, cached + chunk):
            tok.append(0); pos.append(p); seq_of.append(row)
            slot.append(table[p // bs] * bs + p % bs)
            q_rows.append(rng.standard_normal((H, D)).astype(np.float32))
            k_rows.append(k_all[p]); v_rows.append(v_all[p])
    batch = ForwardBatch(np.array(tok, np.int32), np.array(pos, np.int32), np.array(slot, np.int64),
                         np.array(seq_of, np.int32), tables, np.array([len(tok) - 1], np.int64))
    lay = StepLayout.build(batch, bs, dev)
    write_kv(kc, vc, on(np.stack(k_rows)), on(np.stack(v_rows)), lay.slots)
    q = on(np.stack(q_rows))
    out = paged_attention(q, kc, vc, lay, 0.3, window).cpu().numpy()
    for t in range(len(tok)):
        cached, chunk, table, k_all, v_all = seqs[order[seq_of[t]]]
        ref = dense_reference(q_rows[t], k_all, v_all, pos[t], window, 0.3)
        np.testing.assert_allclose(out[t], ref, rtol=1e-4, atol=1e-5)


# -- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runners(gemma3_path):
    return (ModelRunner.load(str(gemma3_path), BACKEND, kv_budget_bytes=96 << 20, torch_dtype=F32),
            exact_cpu(ModelRunner.load(str(gemma3_path), "cpu", kv_budget_bytes=96 << 20)))


def test_weights_format_and_cache(runners):
    rt, _ = runners
    assert rt.ops.weights_format == "float32" and rt.ops.device.type == DEVICE
    # 16-bit K/V on the CPU (llama.cpp's rounding); a GPU keeps them in the compute dtype
    kv = torch.float16 if DEVICE == "cpu" else torch.float32
    assert rt.kv.k[0].dtype == kv and rt.kv.k[0].shape[1:] == (16, 1, 256)


def test_logits_match_numba_with_chunked_prefill_and_decode(runners, gemma3_path):
    rt, rc = runners
    from edgeinfer.formats.tokenizer import Tokenizer
    from edgeinfer.formats.gguf_file import read_gguf
    tok = Tokenizer.from_gguf(read_gguf(str(gemma3_path)).metadata)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    rng = np.random.default_rng(3)
    seq = _Seq([int(b) for b in rng.permutation(min(rt.kv_plan.num_blocks, rc.kv_plan.num_blocks))[:8]])
    # a prefill in two chunks (the second attends over cached keys), then decode steps
    for r in (rt, rc):
        r.forward([_Chunk(seq, 0, ids[:13], needs_logits=False)])
    a = rt.forward([_Chunk(seq, 13, ids[13:])])
    b = rc.forward([_Chunk(seq, 13, ids[13:])])
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    assert a.argmax() == b.argmax()
    n = len(ids)
    for i in range(8):
        t = int(b.argmax())
        a = rt.forward([_Chunk(seq, n + i, [t])])
        b = rc.forward([_Chunk(seq, n + i, [t])])
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max(), i
        assert a.argmax() == b.argmax()


def test_sliding_window_long_prompt_matches_numba(runners, gemma3_path):
    """> 512 tokens: the local layers must drop keys older than the window (chunked prefill)."""
    rt, rc = runners
    ids = [2] + [int(t) for t in np.random.default_rng(5).integers(300, 20000, 639)]
    seq = _Seq(list(range(40, 80)))
    out = []
    for r in (rt, rc):
        r.forward([_Chunk(seq, 0, ids[:300], needs_logits=False)])
        out.append(r.forward([_Chunk(seq, 300, ids[300:])]))
    a, b = out
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    assert a.argmax() == b.argmax()


def test_logits_top1_vs_llama_cpp_teacher_forcing(runners, gemma3_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    rt, _ = runners
    llm = llama_cpp.Llama(model_path=str(gemma3_path), n_ctx=256, logits_all=True, n_threads=2,
                          verbose=False)
    ids = llm.tokenize(b"Water boils at one hundred degrees Celsius at sea level, and the "
                       b"boiling point drops as altitude increases because")
    llm.eval(ids)
    ref = np.array(llm.scores[:len(ids)], np.float32)
    llm.close()
    seq = _Seq(list(range(100, 110)))
    ours = np.concatenate([rt.forward([_Chunk(seq, i, [ids[i]])]) for i in range(len(ids))])
    agree = ours.argmax(1) == ref.argmax(1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(ours - ref).max(axis=1)
    assert agree[decisive].all() and agree.mean() >= 0.9, agree


# -- through the engine ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(gemma3_path):
    cfg = dict(kv_budget_bytes=96 << 20, max_running_seqs=8)
    ec = Engine(str(gemma3_path), EngineConfig(backend="cpu", **cfg))
    exact_cpu(ec.runner)
    return Engine(str(gemma3_path), EngineConfig(backend=BACKEND, torch_dtype=F32, **cfg)), ec


def test_greedy_32_tokens_equal_numba(engines):
    et, ec = engines
    for text in PROMPTS:
        ids = et.encode_raw(text)
        a = et.generate(ids, greedy(32)).token_ids
        b = ec.generate(ids, greedy(32)).token_ids
        assert a == b, text


@pytest.mark.slow      # 22 s; the numba engine's batch invariance is in the default run
def test_batch_invariance(engines):
    et, _ = engines
    prompts = [et.encode_raw(t) for t in PROMPTS + ["Photosynthesis converts light into"]]
    alone = [et.generate(p, greedy(16)).token_ids for p in prompts]
    order = list(range(4))
    random.Random(7).shuffle(order)
    # staggered arrival: two start together, the others join while those decode
    events: dict[int, list[int]] = {}
    sink = lambda o: events.setdefault(o.request_id, []).extend(o.token_ids)  # noqa: E731
    rid = {}
    for n, i in enumerate(order):
        rid[i] = et.submit(prompts[i], greedy(16), sink)
        if n >= 1:
            et._drain_commands()
            for _ in range(n):
                et.step()
    et._drain_commands()
    while et.scheduler.has_work():
        et.step()
    for i in range(4):
        assert events[rid[i]] == alone[i], (i, order)


def test_prefix_reuse(engines):
    et, _ = engines
    ids = et.encode_raw("In the beginning of the twentieth century, physicists discovered that "
                        "light behaves both as a wave and as a particle, which led to")
    assert len(ids) > 16   # at least one full block to share
    first = et.generate(ids, greedy(16))
    second = et.generate(ids, greedy(16))
    assert second.num_cached_tokens > 0
    assert second.token_ids == first.token_ids


# -- device selection and memory refusal ------------------------------------------------------
def test_detect_and_auto_choice():
    info = detect()
    assert info.kind in ("cuda", "mps", "cpu") and info.total_bytes > 0
    expected = {"cuda": "torch:cuda", "mps": "torch:mps", "cpu": "cpu"}[info.kind]
    assert resolve("auto", None, "gemma3") == expected
    assert resolve("auto", None, "phi2") == "llamacpp"
    assert resolve("torch:cpu") == "torch:cpu"


def test_refuses_when_model_does_not_fit():
    info = detect("cpu")
    with pytest.raises(InsufficientMemory, match="GiB"):
        check_fits(info, info.free_bytes * 2, "the model")
    check_fits(info, 1 << 20, "a small model")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_models_match_numba(arch):
    from synth import synthetic_model
    path = synthetic_model(Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth",
                           arch, "Q4_K_M")
    rt = ModelRunner.load(str(path), BACKEND, kv_budget_bytes=8 << 20, torch_dtype=F32)
    rc = exact_cpu(ModelRunner.load(str(path), "cpu", kv_budget_bytes=8 << 20))
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 250, 48)]
    # one table for every pool: the CPU runner's sliding-window layers (gemma3) read it too
    pools = [rt.kv_plan.num_blocks, rc.kv_plan.num_blocks] + [
        p.window_blocks for p in (rt.kv_plan, rc.kv_plan) if p.window_blocks]
    seq = _Seq(list(np.random.default_rng(2).permutation(min(pools))[:5]))
    a = np.concatenate([rt.forward([_Chunk(seq, 0, tokens[:40])])] +
                       [rt.forward([_Chunk(seq, i, [tokens[i]])]) for i in range(40, 48)])
    b = np.concatenate([rc.forward([_Chunk(seq, 0, tokens[:40])])] +
                       [rc.forward([_Chunk(seq, i, [tokens[i]])]) for i in range(40, 48)])
    assert np.abs(a - b).max() <= 0.02 * np.abs(b).max()
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.85


def test_info_command(capsys):
    from edgeinfer.cli.main import main
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto picks" in out and resolve("auto") in out and "GiB" in out


def test_bf16_weights_opt_in(gemma3_path, runners):
    """EDGEINFER_TORCH_DTYPE=bfloat16 (the GPU default; an opt-in on the CPU): same top-1,
    looser logits."""
    from edgeinfer.backends.torch.ops import TorchOps
    from edgeinfer.runners.base import plan_kv
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    gf = read_gguf(str(gemma3_path))
    cfg = load_model_config(gf)
    ops = TorchOps(DEVICE, dtype="bfloat16")
    assert ops.weights_format == "bfloat16"
    r = ModelRunner(gf, cfg, ops, plan_kv(cfg, 8 << 20, 2))
    _, rc = runners
    seq = _Seq([0, 1])
    ids = [2, 818, 5279, 529, 7001, 563]
    a, b = r.forward([_Chunk(seq, 0, ids)]), rc.forward([_Chunk(seq, 0, ids)])
    assert a.argmax() == b.argmax()
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()


def test_load_refused_or_kv_capped_by_free_memory(gemma3_path, monkeypatch):
    """The model is refused before any weight loads when it cannot fit; otherwise the KV pool
    is sized from what remains free after the weights."""
    from edgeinfer.backends.torch import device as dev
    from edgeinfer.backends.torch.device import DeviceInfo
    from edgeinfer.backends.torch.weights import dense_bytes
    from edgeinfer.formats.gguf_file import read_gguf
    need = dense_bytes(read_gguf(str(gemma3_path)), torch.float32)
    small = DeviceInfo("cpu", "test", 4 << 30, need // 2, 2)
    monkeypatch.setattr(dev, "detect", lambda kind=None: small)
    with pytest.raises(InsufficientMemory, match=r"needs 1\.\d\d GiB .* has 0\.\d\d GiB free"):
        ModelRunner.load(str(gemma3_path), "torch", kv_budget_bytes=1 << 30)
    from edgeinfer.backends.torch.ops import TorchOps
    roomy = DeviceInfo("cpu", "test", 4 << 30, int(need * 1.25), 2)
    monkeypatch.setattr(dev, "detect", lambda kind=None: roomy)
    budget = TorchOps("cpu").fit_kv_budget(read_gguf(str(gemma3_path)), 1 << 30)
    assert 0 < budget <= int(need * 1.25 * 0.9) - need < 1 << 30


def test_matrices_read_together_share_one_gemm():
    """ops.matmuls over q/k/v-like matrices: one buffer after the first call, the tensors
    re-pointed into it (same values, no second copy), the products equal to separate ones;
    views of a larger tensor are left alone."""
    from edgeinfer.backends.torch.ops import TorchOps
    ops = TorchOps(device=DEVICE, dtype=F32, check_memory=False)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=g).to(ops.device) for n in (64, 16, 16)]
    before = [w.clone() for w in ws]
    x = torch.randn(5, 64, generator=g).to(ops.device)
    first = ops.matmuls(x, ws)
    assert all(torch.equal(a, b) for a, b in zip(ws, before))
    ptr = ws[0].untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == ptr for w in ws)
    again = ops.matmuls(x, ws)
    for a, b, w in zip(first, again, ws):
        assert a.shape == (5, w.shape[0])
        assert torch.allclose(a, x @ w.T, rtol=1e-5, atol=1e-5)
        assert torch.allclose(b, x @ w.T, rtol=1e-5, atol=1e-5)
    big = torch.randn(96, 64, generator=g).to(ops.device)
    views = [big[:64], big[64:]]
    out = ops.matmuls(x, views)
    assert big.untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    assert torch.allclose(out[1], x @ big[64:].T, rtol=1e-5, atol=1e-5)
