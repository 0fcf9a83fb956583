"""f16 vs q8_0 KV cache: bytes per token, decode tok/s at 0 / 2K / 8K tokens of context, ours and
llama.cpp's (type_k = type_v = q8_0 with flash attention), in interleaved rounds.

    .venv/bin/python benchmarks/kv_cache_type.py [--model PATH] [--threads 2] [--rounds 3]
        [--depths 0,2048,8192] [--decode 32] [--no-llamacpp] [--markdown FILE]

Per configuration the context is filled once (prefill in 512-token chunks, not timed). A round
decodes `--decode` greedy tokens after it with every configuration, one token of each in turn
(so drift on a loaded machine hits all of them alike), and adds up each one's step times.
Reported: the median tok/s of the rounds and their range, and each q8_0 row's ratio to f16
(the median of the per-round ratios).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env, table  # noqa: E402

TEXT = ("The river runs past the old mill, under the stone bridge and out to the sea, where "
        "the fishing boats wait for the tide. ")


class Ours:
    def __init__(self, path: str, kv: str, depth: int, decode: int):
        import numpy as np
        from edgeinfer.formats.tokenizer import Tokenizer
        from edgeinfer.runners.base import ScheduledSpan
        from edgeinfer.runners.native import ModelRunner
        self.np, self.Span = np, ScheduledSpan
        need = depth + decode * 8 + 64
        self.r = ModelRunner.load(path, kv_budget_bytes=0, min_kv_tokens=need, kv_cache_type=kv)
        tok = Tokenizer.from_gguf(self.r.gf.metadata)
        ids = tok.encode(TEXT * (depth // 20 + 2))[: max(depth, 1)]
        self.table = tuple(range(self.r.kv_plan.num_blocks))
        self.depth, self.decode = len(ids), decode
        self.kv_bytes_per_token = self.r.kv_plan.bytes_per_token
        for s in range(0, len(ids), 512):
            self.last = self._step(s, ids[s:s + 512])

    def _step(self, start, ids):
        logits = self.r.forward([self.Span(0, start, tuple(ids), self.table, True)])
        return int(self.np.argmax(logits[-1]))

    def begin(self) -> None:
        """A round decodes after the context again (the same positions are rewritten)."""
        self.t, self.i = self.last, 0

    def step(self) -> float:
        t0 = time.perf_counter()
        self.t = self._step(self.depth + self.i, [self.t])
        self.i += 1
        return time.perf_counter() - t0


class Llama:
    def __init__(self, path: str, kv: str, depth: int, decode: int, threads: int):
        import llama_cpp
        import numpy as np
        kw = dict(type_k=8, type_v=8, flash_attn=True) if kv == "q8_0" else {}
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=depth + decode * 2 + 64,
                                   n_batch=512, n_threads=threads, n_threads_batch=threads,
                                   verbose=False, **kw)
        ids = self.llm.tokenize((TEXT * (depth // 20 + 2)).encode(), add_bos=True)[: max(depth, 1)]
        self.llm.eval(ids)
        self.np, self.depth, self.decode = np, len(ids), decode
        self.n_vocab = self.llm.n_vocab()
        self.last = self._argmax()
        self.kv_bytes_per_token = None

    def _argmax(self) -> int:
        """The last evaluated row's argmax, read from llama.cpp's own logits (`scores` holds
        only n_batch rows without logits_all, and logits_all at 8K would be 8 GB)."""
        import llama_cpp
        p = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(self.np.argmax(self.np.ctypeslib.as_array(p, shape=(self.n_vocab,))))

    def begin(self) -> None:
        self.llm.n_tokens = self.depth  # eval() drops the cells past it (the last round's)
        self.t = self.last

    def step(self) -> float:
        t0 = time.perf_counter()
        self.llm.eval([self.t])
        self.t = self._argmax()
        return time.perf_counter() - t0


def round_robin(runs: dict, decode: int) -> dict:
    """One round: `decode` tokens from each configuration, a token of each in turn."""
    spent = {k: 0.0 for k in runs}
    for r in runs.values():
        r.begin()
    for _ in range(decode):
        for k, r in runs.items():
            spent[k] += r.step()
    return {k: decode / t for k, t in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="0,2048,8192")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    setup_env(a.threads)
    import numba
    numba.set_num_threads(a.threads)
    from edgeinfer.settings import Settings, install
    install(Settings.from_env(threads=a.threads))
    path = model_path(a.model)
    depths = [int(d) for d in a.depths.split(",")]
    engines = [("ours", "f16"), ("ours", "q8_0")]
    if not a.no_llamacpp:
        engines += [("llama.cpp", "f16"), ("llama.cpp", "q8_0")]
    rows = []
    for depth in depths:
        runs = {}
        for who, kv in engines:     # one context per configuration, filled once
            print(f"depth {depth}: filling {who} {kv} ...", file=sys.stderr, flush=True)
            runs[(who, kv)] = (Ours(path, kv, depth, a.decode) if who == "ours"
                               else Llama(path, kv, depth, a.decode, a.threads))
        round_robin(runs, 2)        # warm-up (compiles, first touch of the pool)
        res = {k: [] for k in runs}
        for rnd in range(a.rounds):
            for k, v in round_robin(runs, a.decode).items():
                res[k].append(v)
            print(f"depth {depth} round {rnd + 1}: " + ", ".join(
                f"{w} {kv} {res[(w, kv)][-1]:.1f}" for w, kv in runs), file=sys.stderr, flush=True)
        for who, kv in engines:
            v = res[(who, kv)]
            base = res[(who, "f16")]
            ratio = statistics.median(x / y for x, y in zip(v, base))
            bpt = runs[(who, kv)].kv_bytes_per_token
            rows.append([depth, who, kv, bpt if bpt else "-", statistics.median(v),
                         f"{min(v):.1f}-{max(v):.1f}", f"{ratio:.2f}x"])
        del runs
    out = table(f"Decode tok/s after a context of N tokens ({a.threads} threads, "
                f"{a.decode} tokens per round, medians of {a.rounds} interleaved rounds)",
                ["context", "engine", "KV", "KV B/token", "tok/s", "range", "vs f16"], rows)
    print(out)
    if a.markdown:
        Path(a.markdown).write_text(out + "\n")


if __name__ == "__main__":
    main()
