"""Engine decode and prefill with the working tree's repacked weights vs a git revision's.

    .venv/bin/python benchmarks/repack_decode_ab.py --base 7c317cb [--rounds 5] [--threads 2]

One engine (Gemma 3 270M, the bundled model), two sets of weights: ours, and every matrix
repacked by --base's repack.py and multiplied by its tile kernel (benchmarks/repack_ab.py
loads them; a shim in front of packed.py's kernel call sends each matrix to its own kernel).
Rounds alternate the two sets on the same engine; each measures a 512-token prefill step and
64 greedy decode steps (tokens/s from the median step), and checks both sets generate the
same tokens. Prints the median and range of each and the ratio of medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env  # noqa: E402

FIELDS = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
          "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    setup_env(a.threads)
    import numpy as np

    from edgeinfer.backends.cpu import _int8, packed
    from edgeinfer.backends.cpu.quants import QuantMatrix
    from edgeinfer.backends.cpu.repack import PackedMatrix
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from repack_ab import load_base

    old8, oldrp = load_base(a.base)

    class OldPacked(PackedMatrix):
        """A base-layout matrix in our PackedMatrix's clothes: fmt < 0 marks it for the shim."""
        def rows(self, ids):
            return self.base.rows(ids)

    def as_old(w: QuantMatrix) -> PackedMatrix:
        p = oldrp.PackedMatrix.from_quant(w)
        o = OldPacked(p.q, None, p.s, p.o, None, None, p.has_o, p.zero_point, p.B, p.A,
                      p.qtype, p.K, p.N, 8, -2 if p.has_o else -1)
        object.__setattr__(o, "base", p)
        return o

    class Shim:
        HAVE_VNNI = _int8.HAVE_VNNI
        HAVE_SIMD = _int8.HAVE_SIMD

        @staticmethod
        def int8_matmul(q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, vnni, nw, counter):
            if fmt < 0:
                return old8.int8_matmul(q, s, o, fmt == -2, qa, da, bsf, zb, out, vnni, nw, counter)
            return _int8.int8_matmul(q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, vnni, nw,
                                     counter)
    packed._int8 = Shim

    path = model_path(a.model)
    engine = Engine(path, EngineConfig(kv_budget_bytes=256 << 20, max_model_len=4096,
                                       max_tokens_per_step=2048, threads=a.threads,
                                       speculative=False))
    model = engine.runner.model
    gf = engine.runner.gf
    new_set = {"head": (model.tok_embd, model.output),
               "layers": [{f: getattr(w, f) for f in FIELDS} for w in model.layers]}
    emb = as_old(QuantMatrix.from_gguf(gf, "token_embd.weight"))
    tied = model.output is model.tok_embd
    old_set = {"head": (emb, emb if tied else as_old(QuantMatrix.from_gguf(gf, "output.weight"))),
               "layers": [{f: as_old(QuantMatrix.from_gguf(gf, f"blk.{i}.{n}.weight"))
                           for f, n in FIELDS.items()} for i in range(len(model.layers))]}
    nbytes = {k: sum(m.nbytes for m in ([s["head"][0]] + ([] if tied else [s["head"][1]])
                                        + [m for lw in s["layers"] for m in lw.values()]))
              for k, s in (("base", old_set), ("ours", new_set))}

    def use(ws):
        model.tok_embd, model.output = ws["head"]
        for w, d in zip(model.layers, ws["layers"]):
            for f, m in d.items():
                object.__setattr__(w, f, m) if dataclasses.is_dataclass(w) else setattr(w, f, m)

    rng = np.random.default_rng(3)
    prompt = [2] + [int(x) for x in rng.integers(1000, 100_000, 511)]

    def run() -> tuple[float, float]:
        rid = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=a.tokens + 1,
                                                   ignore_eos=True), lambda o: None)
        engine._drain_commands()
        t0 = time.perf_counter()
        engine.step()                                       # the 512-token prefill
        pre = time.perf_counter() - t0
        steps = []
        while engine.scheduler.get(rid) is not None:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return pre, statistics.median(steps)

    outs = {}
    for name, ws in (("base", old_set), ("ours", new_set)):
        use(ws)
        r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=a.tokens,
                                                   ignore_eos=True))
        outs[name] = r.token_ids
    same = outs["base"] == outs["ours"]
    res = {"base": ([], []), "ours": ([], [])}
    for r in range(a.rounds):
        order = (("base", old_set), ("ours", new_set)) if r % 2 == 0 else \
            (("ours", new_set), ("base", old_set))
        for name, ws in order:
            use(ws)
            prompt[1] = 1000 + 7 * r + (name == "ours")       # no prefix-cache hit
            pre, step = run()
            res[name][0].append(512 / pre)
            res[name][1].append(1 / step)
    print(f"weights read per decode token: base {nbytes['base'] / 1e6:.1f} MB, ours "
          f"{nbytes['ours'] / 1e6:.1f} MB; same {a.tokens} greedy tokens: {same}")
    for i, label in enumerate(("prefill tok/s (512)", "decode tok/s")):
        b, o = res["base"][i], res["ours"][i]
        print(f"{label:20} base {statistics.median(b):7.1f} [{min(b):.1f}-{max(b):.1f}]   ours "
              f"{statistics.median(o):7.1f} [{min(o):.1f}-{max(o):.1f}]   ours/base "
              f"{statistics.median(o) / statistics.median(b):.3f}   ({a.threads} threads, "
              f"{a.rounds} rounds)")
    engine.close()


if __name__ == "__main__":
    main()
