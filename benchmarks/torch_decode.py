"""The torch backend's decode path with and without CUDA graphs (backends/torch/graphs.py).

    python benchmarks/torch_decode.py --model PATH [--device cuda] [--streams 1,8,32]
        [--tokens 128] [--prefill 512] [--rounds 3] [--check 4]

Two engines on the same file, `torch_graphs` off and on (EDGEINFER_TORCH_GRAPHS), in the
device's default dtype (bf16 on CUDA), measured through the engine as a user's request runs:
- decode tok/s: N requests of --tokens greedy tokens submitted together after short prompts,
  tokens after the first of each / time after the first step;
- prefill tok/s: one --prefill-token prompt, time to its first token;
rounds interleaved (off, on, off, on...), medians with the range. Then --check prompts of
greedy text, graphs off against on, in the default dtype and in float32, and in float32
each prompt alone against all of them together (the padded buckets must not change a row).
Prints peak device memory; --profile adds the GPU kernels of one decode step (the padded
static forward, run op by op: the kernels a replay runs), by total time. Random-weight files
(shaped_model.py --ftype F16) suit the speed figures; the text checks compare the two paths
with each other, so any weights do.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import numpy as np


def engine(path: str, device: str, graphs: bool, dtype: str | None = None):
    from edgeinfer.engine.core import Engine, EngineConfig
    return Engine(path, EngineConfig(backend=f"torch:{device}", torch_dtype=dtype,
                                     torch_graphs=graphs, kv_budget_bytes=2 << 30,
                                     max_running_seqs=64, max_tokens_per_step=2048,
                                     speculative=False))


class Run(NamedTuple):
    decode_s: float          # from the first step's tokens to the end
    decode_tokens: int       # tokens after each request's first
    outs: list               # each request's tokens, in submission order
    ttft_s: float            # from submitting to the first token


def run_all(eng, prompts, n) -> Run:
    """The prompts submitted together, n greedy tokens each, stepped to the end."""
    from edgeinfer.engine.core import greedy
    got: dict[int, list[int]] = {}
    first: list[float] = []

    def sink(o):
        got.setdefault(o.request_id, []).extend(o.token_ids)
        if o.token_ids and not first:
            first.append(time.perf_counter())
    ids = [eng.submit(p, greedy(n, ignore_eos=True), sink) for p in prompts]
    t0 = time.perf_counter()
    eng._drain_commands()
    while eng.scheduler.has_work():
        eng.step()
    t1 = time.perf_counter()
    outs = [got.get(i, []) for i in ids]
    t_first = first[0] if first else t0
    return Run(t1 - t_first, sum(len(o) for o in outs) - len(outs), outs, t_first - t0)


def prompts_for(rng, n, length, vocab):
    return [[int(t) for t in rng.integers(100, min(vocab, 30000), length)] for _ in range(n)]


def profile_step(eng, device: str, rows: int = 1, context: int = 64) -> None:
    """torch.profiler over one padded decode step, run op by op: kernels by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from edgeinfer.runners.base import ScheduledSpan
    r = eng.runner
    d = r._decode
    if d is None:
        print("no decode graphs on this engine")
        return
    table = tuple(range(context // r.kv_plan.block_size + 1))
    spans = [ScheduledSpan(i, context, (100 + i,), table, True) for i in range(rows)]
    from edgeinfer.runners.native import build_forward_batch
    batch = build_forward_batch(spans, r.kv_plan.block_size)
    S, NB = d.bucket_of(batch)
    d._stage(batch, S, NB)
    r.model.forward(d._padded(S, NB), r.kv)     # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as p:
        r.model.forward(d._padded(S, NB), r.kv)
        if device == "cuda":
            torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in kernels)
    print(f"one decode step ({rows} row, {r.cfg.n_layers} layers): {len(kernels)} kernels, "
          f"{total / 1e3:.2f} ms of kernel time")
    print(p.key_averages().table(sort_by="device_time_total" if device == "cuda"
                                 else "cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import torch
    streams = [int(s) for s in a.streams.split(",")]
    t = time.perf_counter()
    engines = {g: engine(a.model, a.device, g) for g in (False, True)}
    print(f"loaded both engines in {time.perf_counter() - t:.1f} s; "
          f"{engines[True].runner.ops.weights_format}, {engines[True].cfg.n_layers} layers, "
          f"vocab {engines[True].cfg.vocab_size}", flush=True)
    vocab = engines[True].cfg.vocab_size
    rng = np.random.default_rng(0)
    res: dict[tuple, list[float]] = {}
    for r in range(a.rounds):
        for n in streams:
            ps = prompts_for(rng, n, 16, vocab)
            for g, eng in engines.items():
                run = run_all(eng, ps, a.tokens)
                res.setdefault(("decode", n, g), []).append(run.decode_tokens / run.decode_s)
        long = prompts_for(rng, 1, a.prefill, vocab)
        for g, eng in engines.items():
            res.setdefault(("prefill", a.prefill, g), []).append(
                a.prefill / run_all(eng, long, 1).ttft_s)
        print(f"round {r + 1} done", flush=True)
    print(f"\n{'what':>14} | {'graphs off':>22} | {'graphs on':>22} | on/off")
    for (what, n, g) in sorted(k for k in res if not k[2]):
        off, on = res[(what, n, False)], res[(what, n, True)]
        fmt = lambda v: f"{statistics.median(v):8.1f} [{min(v):.1f}-{max(v):.1f}]"  # noqa: E731
        print(f"{what + ' ' + str(n):>14} | {fmt(off):>22} | {fmt(on):>22} | "
              f"{statistics.median(on) / statistics.median(off):.2f}x", flush=True)
    if a.device == "cuda":
        print(f"peak device memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if a.profile:
        profile_step(engines[True], a.device)
    # greedy text: graphs off vs on, then float32 alone vs batched through the graphs
    ps = prompts_for(np.random.default_rng(1), a.check, 24, vocab)
    outs = {g: run_all(eng, ps, 48).outs for g, eng in engines.items()}
    print(f"default dtype, greedy 48 tokens, graphs on == off: "
          f"{sum(x == y for x, y in zip(outs[False], outs[True]))}/{len(ps)}")
    del engines
    f32 = {g: engine(a.model, a.device, g, "float32") for g in (False, True)}
    outs = {g: run_all(eng, ps, 48).outs for g, eng in f32.items()}
    print(f"float32, greedy 48 tokens, graphs on == off: "
          f"{sum(x == y for x, y in zip(outs[False], outs[True]))}/{len(ps)}")
    alone = [run_all(f32[True], [p], 48).outs[0] for p in ps]
    print(f"float32, graphs on, alone == batched: "
          f"{sum(x == y for x, y in zip(alone, outs[True]))}/{len(ps)}")
    d = f32[True].runner._decode
    print("recorded buckets (rows, blocks):", sorted(d._graphs) if d else None,
          "disabled" if d and d.disabled else "")


if __name__ == "__main__":
    main()
