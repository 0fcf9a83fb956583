"""Numerical fidelity as llama.cpp measures quantizations: KL divergence from a reference.

    .venv/bin/python benchmarks/fidelity.py [--model PATH] [--tokens 2048] [--threads 2]
        [--configs int8,float,f32,torch,llamacpp-batch,llamacpp-token] [--markdown FILE]

Greedy text equality is not a sound measure of fidelity: near-ties flip under any change of
rounding and greedy decoding amplifies the flip (issue 19). This is the measure of
`llama-perplexity --kl-divergence`: teacher-force a fixed text through the model and compare,
at every position, the next-token distribution of a configuration with the one of a
high-precision reference:

- reference: the same GGUF weights dequantized by `gguf.quants.dequantize` (the
  quantization itself is what is being served, so it is not an error here) and a plain numpy
  forward pass in float64, with no activation rounding anywhere (no 8-bit activation
  blocks, no f16 K/V, no f16 GELU table);
- per position: KL(P_ref || Q) in nats, and whether the argmax agrees; over the text: mean,
  median, 99th percentile and max KL, top-1 agreement, and perplexity of the text under each.

Configurations (all on the same tokens, CHUNK positions at a time):
  int8            ours, CPU, weights repacked as int8 tiles (VNNI integer dot; the default
                  on such CPUs)
  float           ours, CPU, GGUF blocks with llama.cpp-style 8-bit activations
                  (EDGEINFER_REPACK=0 / CpuOps(repack=False))
  f32             ours, CPU, numerics="f32": float32 activations everywhere (no rounding)
  torch           ours, torch on the CPU (weights dequantized to the device's dtype)
  llamacpp-batch  llama.cpp (llama-cpp-python's C API), prompt processed 512 tokens a batch
  llamacpp-token  llama.cpp, one token per llama_decode (how it generates)

The text (about 2,000 gemma3 tokens) is written below: prose, code, German, Japanese,
numbers and emoji, so byte-fallback and rare tokens are exercised too. Nothing is fetched.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 128           # positions per step: logits [CHUNK, vocab] per configuration

TEXT = [
    # prose
    "The lighthouse keeper had not spoken to another person in eleven days when the supply "
    "boat finally appeared on the horizon. She watched it grow from a grey smudge into a "
    "vessel with a red hull and a crooked mast, rising and falling on a swell that had not "
    "settled since the storm. In the logbook she wrote the time, the wind direction, and a "
    "single word she had never used before in an official record: relief. Later, when the "
    "inspector asked her about the entry, she told him that the lamp had needed a new "
    "mantle, which was true, and that the word referred to the mantle, which was not. "
    "Most of the work on the island was repetition. Every evening the lens had to be "
    "wound, every morning the glass had to be cleaned of salt, and every week the oil "
    "stores had to be counted twice, because the first count was always wrong. ",
    # code
    "import heapq\nfrom dataclasses import dataclass, field\n\n\n@dataclass(order=True)\n"
    "class Job:\n    priority: int\n    name: str = field(compare=False)\n    retries: int = "
    "field(default=0, compare=False)\n\n\ndef schedule(jobs: list[Job], workers: int = 4) -> "
    "dict[int, list[str]]:\n    \"\"\"Assign jobs to workers, highest priority first.\"\"\"\n"
    "    heap = [(-j.priority, i, j) for i, j in enumerate(jobs)]\n    heapq.heapify(heap)\n"
    "    load = {w: 0 for w in range(workers)}\n    plan: dict[int, list[str]] = {w: [] for w "
    "in range(workers)}\n    while heap:\n        _, _, job = heapq.heappop(heap)\n        w = "
    "min(load, key=load.get)\n        plan[w].append(job.name)\n        load[w] += "
    "job.priority + job.retries\n    return plan\n\n\nif __name__ == \"__main__\":\n    jobs = "
    "[Job(3, \"backup\"), Job(9, \"deploy\", 2), Job(1, \"cleanup\")]\n    for worker, names in "
    "schedule(jobs, 2).items():\n        print(f\"worker {worker}: {', '.join(names)}\")\n\n"
    "SELECT c.name, COUNT(o.id) AS orders, SUM(o.total) AS revenue\nFROM customers c\nLEFT "
    "JOIN orders o ON o.customer_id = c.id\nWHERE o.created_at >= '2024-01-01'\nGROUP BY c.name\n"
    "HAVING COUNT(o.id) > 3\nORDER BY revenue DESC\nLIMIT 10;\n\n",
    # German
    "Am Rande der Stadt, dort wo die Straßenbahn ihre letzte Schleife dreht, steht eine "
    "Bäckerei, die seit 1923 von derselben Familie geführt wird. Die Großmutter backt noch "
    "heute jeden Donnerstag den Streuselkuchen nach dem alten Rezept, obwohl ihr Enkel "
    "längst die Buchhaltung auf ein Tablet umgestellt hat. „Mehl, Butter, Zucker und Geduld“, "
    "sagt sie, wenn Kunden nach dem Geheimnis fragen. Über die neuen Öffnungszeiten, die "
    "Lieferungen per Lastenfahrrad und die Frage, ob man glutenfreie Brötchen anbieten "
    "sollte, wird am Küchentisch heftig gestritten. Einig ist man sich nur darin, dass die "
    "Schrippen um sechs Uhr früh fertig sein müssen, egal was passiert. ",
    # Japanese
    "京都の古い町家を改装した小さな宿では、朝になると庭の苔に水をまく音が聞こえる。宿の主人は"
    "七十歳を過ぎているが、毎朝五時に起きて、季節の花を玄関に飾る。春には桜、夏には紫陽花、秋には"
    "紅葉した楓の枝、冬には椿。外国から来た客は、その花の名前を一つずつ尋ね、主人は辞書を片手に"
    "ゆっくりと英語で答える。「言葉が通じなくても、花は通じる」というのが彼の口癖だ。近くの市場で"
    "買った漬物と味噌汁、焼き魚の朝食は、一泊二食付きで一万二千円。予約は電話のみで、インターネット"
    "では受け付けていない。それでも部屋は半年先まで埋まっている。",
    # numbers
    "Quarterly report, fiscal year 2025. Revenue: $4,182,907.55 (+12.4% YoY). Operating "
    "costs: $3,011,442.10. Net margin: 28.0%. Headcount rose from 87 to 112; attrition fell "
    "to 6.25%. Conversion table: 1 mile = 1.609344 km; 1 lb = 0.45359237 kg; 0 degC = 32 degF "
    "= 273.15 K. Sequence check: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53. "
    "pi ~ 3.14159265358979; e ~ 2.71828182845905; sqrt(2) ~ 1.41421356237310. Timestamps: "
    "2025-03-14T09:26:53Z, 2025-11-02T23:59:59+01:00. Order #A-20931-X shipped 14/03/2025 "
    "in 3 boxes (12.5 kg, 8.75 kg, 0.9 kg); tracking 1Z999AA10123456784. IPv4 192.168.0.254, "
    "port 8443; checksum 0x7F3A9C2E; version 3.11.7. ",
    # emoji and chat
    "Team chat, Friday 17:42 🎉\n@maria: build is green again ✅🚀 thanks everyone!!\n@tom: "
    "finally 😅 the flaky test was a timezone bug 🕐🌍\n@maria: classic. pizza on me next "
    "week 🍕🍕\n@li: can we also fix the dark-mode contrast? 🌙👀 the buttons are unreadable\n"
    "@tom: 👍 adding it to the board\n@maria: reminder: release notes by Monday 📝, demo "
    "Tuesday 10:00 🎥, retro Wednesday ☕\n@li: 🙏 ok ok\n@tom: have a good weekend all ⛰️🚲🌧️ ",
    # a recipe, with fractions and units
    "Lemon ricotta pancakes (serves 4). Whisk 250 g ricotta, 3 eggs, 180 ml milk, the zest of "
    "2 lemons and 1 tbsp sugar. In a second bowl mix 150 g flour, 1 1/2 tsp baking powder and "
    "a pinch of salt; fold the dry ingredients into the wet ones until just combined - a few "
    "lumps are fine. Heat a heavy pan over medium heat (about 180 degC), brush with butter, "
    "and pour 1/4 cup of batter per pancake. Cook 2-3 minutes until bubbles form at the "
    "edges, flip, and cook 1 1/2 minutes more. Serve with blueberries, maple syrup, or a "
    "spoon of Greek yoghurt. Tip: if the batter thickens while resting, add 1-2 tbsp milk. ",
    # JSON and a shell session
    "$ curl -s http://localhost:8080/api/v2/items?limit=2 | jq .\n{\n  \"items\": [\n    {\"id\": "
    "17, \"name\": \"widget\", \"price\": 9.99, \"tags\": [\"blue\", \"small\"], \"stock\": null},\n"
    "    {\"id\": 18, \"name\": \"gadget\", \"price\": 24.5, \"tags\": [], \"stock\": 3}\n  ],\n"
    "  \"next\": \"/api/v2/items?limit=2&after=18\"\n}\n$ git log --oneline -3\n4efd09d Fix "
    "off-by-one in pagination\n992dfe2 Add price filter\na705569 Initial commit\n$ echo $?\n0\n",
    # more prose, another register
    "Abstract. We study the effect of low-precision arithmetic on the calibration of "
    "autoregressive language models. Holding the weights fixed, we vary only the rounding of "
    "intermediate activations and of the attention cache, and measure the divergence of the "
    "predicted next-token distribution from a double-precision reference. We find that the "
    "divergence is concentrated on a small fraction of positions, typically those where two "
    "or more continuations are nearly equally likely, and that greedy decoding converts "
    "these small differences into visibly different text within a few dozen tokens. We "
    "argue that token-level agreement of generated text is therefore a misleading metric, and "
    "recommend reporting the mean and tail of the per-position divergence instead. ",
]


# -- the float64 reference ---------------------------------------------------------------------

class Reference:
    """A plain numpy float64 forward pass over dequantized GGUF weights (llama family, qwen2/3,
    gemma3), mirroring edgeinfer's model files without any activation rounding."""

    def __init__(self, path: str):
        import gguf
        from edgeinfer.formats.gguf_file import read_gguf
        from edgeinfer.formats.model_config import load_model_config
        gf = read_gguf(path)
        try:
            self.cfg = load_model_config(gf)
        finally:
            gf.close()
        self.reader = gguf.GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        c = self.cfg
        self.head = self._f32("output.weight" if "output.weight" in self.tensors
                              else "token_embd.weight")              # [vocab, E] float32

    def _f32(self, name: str) -> np.ndarray:
        import gguf
        t = self.tensors[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, np.float32).reshape([int(x) for x in reversed(t.shape.tolist())]
                                                 if len(t.shape) > 1 else -1)

    def _f64(self, name: str) -> np.ndarray | None:
        return self._f32(name).astype(np.float64) if name in self.tensors else None

    @staticmethod
    def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float,
              factors: np.ndarray | None) -> np.ndarray:
        c = self.cfg
        d = x.shape[-1]
        inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if factors is not None:
            inv = inv / factors
        ang = np.outer(pos.astype(np.float64) / c.rope_scale, inv)[:, None, :]   # [T, 1, d/2]
        cos, sin = np.cos(ang), np.sin(ang)
        if c.rope_neox:
            a, b = x[..., :d // 2], x[..., d // 2:]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out

    def hidden(self, tokens) -> np.ndarray:
        """Final normed hidden states [T, E] float64 of a teacher-forced token sequence."""
        c = self.cfg
        tokens = np.asarray(tokens, np.int64)
        T = len(tokens)
        pos = np.arange(T)
        emb = self._f32("token_embd.weight") if "output.weight" in self.tensors else self.head
        x = emb[tokens].astype(np.float64) * c.embed_scale
        factors = self._f64("rope_freqs.weight")
        gemma = c.arch.startswith("gemma")
        dist = pos[:, None] - pos[None, :]                              # query - key
        for i in range(c.n_layers):
            p = f"blk.{i}."
            g = lambda n: self._f64(p + n)                              # noqa: E731
            local = c.is_sliding(i)
            base = c.rope_base_local if (gemma and local) else c.rope_base
            window = c.sliding_window if local else 0
            h = self._rms(x, g("attn_norm.weight"), c.rms_eps)
            q, k, v = h @ g("attn_q.weight").T, h @ g("attn_k.weight").T, h @ g("attn_v.weight").T
            if p + "attn_q.bias" in self.tensors:
                q, k, v = q + g("attn_q.bias"), k + g("attn_k.bias"), v + g("attn_v.bias")
            q = q.reshape(T, c.n_head, c.head_dim)
            k = k.reshape(T, c.n_kv_head, c.head_dim)
            v = v.reshape(T, c.n_kv_head, c.head_dim)
            if p + "attn_q_norm.weight" in self.tensors:
                q = self._rms(q, g("attn_q_norm.weight"), c.rms_eps)
                k = self._rms(k, g("attn_k_norm.weight"), c.rms_eps)
            q = self._rope(q, pos, base, factors)
            k = self._rope(k, pos, base, factors)
            mask = dist < 0
            if window:
                mask |= dist >= window
            group = c.n_head // c.n_kv_head
            a = np.empty((T, c.n_head, c.head_dim))
            for hh in range(c.n_head):
                s = (q[:, hh] @ k[:, hh // group].T) / np.sqrt(c.head_dim)
                s[mask] = -np.inf
                s -= s.max(axis=1, keepdims=True)
                w = np.exp(s)
                w /= w.sum(axis=1, keepdims=True)
                a[:, hh] = w @ v[:, hh // group]
            o = a.reshape(T, c.q_dim) @ g("attn_output.weight").T
            x = x + (self._rms(o, g("post_attention_norm.weight"), c.rms_eps) if gemma else o)
            h = self._rms(x, g("ffn_norm.weight"), c.rms_eps)
            gate, up = h @ g("ffn_gate.weight").T, h @ g("ffn_up.weight").T
            if c.activation == "gelu_tanh":
                act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
            else:
                act = gate / (1 + np.exp(-gate))
            f = (act * up) @ g("ffn_down.weight").T
            x = x + (self._rms(f, g("post_ffw_norm.weight"), c.rms_eps) if gemma else f)
        return self._rms(x, self._f64("output_norm.weight"), c.rms_eps)

    def logits(self, h: np.ndarray, block: int = 32768) -> np.ndarray:
        """float64 logits [rows, vocab] of final hidden states, the head in vocabulary blocks."""
        out = np.empty((h.shape[0], self.head.shape[0]))
        for v0 in range(0, self.head.shape[0], block):
            out[:, v0:v0 + block] = h @ self.head[v0:v0 + block].astype(np.float64).T
        return out


# -- the measure -------------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def kl_rows(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: KL(P_ref || Q) in nats, and whether the argmaxes agree."""
    lp = log_softmax(ref_logits)
    lq = log_softmax(logits)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return np.maximum(kl, 0.0), ref_logits.argmax(-1) == np.asarray(logits).argmax(-1)


class Tally:
    def __init__(self, name: str):
        self.name, self.kl, self.top1, self.nll = name, [], [], []

    def add(self, ref_logits, logits, targets) -> None:
        kl, same = kl_rows(ref_logits, logits)
        self.kl.append(kl)
        self.top1.append(same)
        n = len(targets)
        lq = log_softmax(np.asarray(logits[:n], np.float64))
        self.nll.append(-lq[np.arange(n), targets])

    def row(self) -> list:
        kl, top1, nll = (np.concatenate(v) for v in (self.kl, self.top1, self.nll))
        return [self.name, float(kl.mean()), float(np.median(kl)), float(np.quantile(kl, 0.99)),
                float(kl.max()), 100.0 * float(top1.mean()), float(np.exp(nll.mean()))]


# -- configurations: each gives float32 logits for positions a..b-1, in order ----------------

class Ours:
    """An edgeinfer ModelRunner driven directly: one request whose KV lives in blocks
    0..n-1, CHUNK positions per forward, logits for every row."""

    def __init__(self, path: str, ops, n_tokens: int):
        from edgeinfer.formats.gguf_file import read_gguf
        from edgeinfer.formats.model_config import load_model_config
        from edgeinfer.runners.base import plan_kv
        from edgeinfer.runners.native import ModelRunner
        gf = read_gguf(path)
        cfg = load_model_config(gf)
        plan = plan_kv(cfg, 0, ops.kv_bytes_per_value, 16, min_tokens=n_tokens + 16)
        self.runner = ModelRunner(gf, cfg, ops, plan)
        self.table = tuple(range(plan.num_blocks))
        self.tokens = None

    def logits(self, tokens, a: int, b: int) -> np.ndarray:
        from edgeinfer.runners.base import ScheduledSpan
        self.runner.ops.begin_step()
        span = ScheduledSpan(1, a, tuple(int(t) for t in tokens[a:b]), self.table, False)
        return self.runner._logits_rows(span, list(range(b - a)))

    def close(self) -> None:
        self.runner.close()


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API (edgeinfer's LlamaContext wrapper)."""

    def __init__(self, path: str, n_tokens: int, per_token: bool, threads: int):
        from edgeinfer.runners.llamacpp.context import LlamaContext
        self.ctx = LlamaContext(path, n_tokens + 64, 1, 512, threads)
        self.per_token = per_token
        self.done = 0            # positions decoded
        self.batch_start = 0     # first position of the last llama_decode (batch mode)

    def logits(self, tokens, a: int, b: int) -> np.ndarray:
        ctx = self.ctx
        if self.per_token:
            rows = []
            for p in range(a, b):
                assert ctx.decode([int(tokens[p])], [p], [0], [True]) == 0
                rows.append(ctx.logits(0))
            return np.stack(rows)
        if b > self.done:        # the next batch of up to n_batch positions, logits for all
            s, e = self.done, min(self.done + ctx.n_batch, len(tokens))
            n = e - s
            assert ctx.decode([int(t) for t in tokens[s:e]], list(range(s, e)), [0] * n,
                              [True] * n) == 0
            self.batch_start, self.done = s, e
        assert a >= self.batch_start and b <= self.done, "chunks must not straddle batches"
        return np.stack([ctx.logits(p - self.batch_start) for p in range(a, b)])

    def close(self) -> None:
        self.ctx.close()


def make_config(name: str, path: str, n_tokens: int, threads: int):
    from edgeinfer.backends.cpu.ops import CpuOps
    if name == "int8":
        return Ours(path, CpuOps(repack=True), n_tokens)
    if name == "float":
        return Ours(path, CpuOps(repack=False), n_tokens)
    if name == "f32":
        return Ours(path, CpuOps(numerics="f32", repack=False), n_tokens)
    if name == "torch":
        from edgeinfer.runners.native import make_ops
        return Ours(path, make_ops("torch:cpu"), n_tokens)
    if name in ("llamacpp-batch", "llamacpp-token"):
        return LlamaCpp(path, n_tokens, name == "llamacpp-token", threads)
    raise SystemExit(f"unknown configuration {name!r}")


LABELS = {
    "int8": "edgeinfer cpu, int8 tiles (default)",
    "float": "edgeinfer cpu, GGUF blocks (REPACK=0)",
    "f32": "edgeinfer cpu, f32 numerics",
    "torch": "edgeinfer torch:cpu",
    "llamacpp-batch": "llama.cpp, 512-token batches",
    "llamacpp-token": "llama.cpp, token by token",
}


def measure(path: str, tokens, names: list[str], threads: int = 2, chunk: int = CHUNK,
            ref: Reference | None = None, log=print) -> list[list]:
    """Rows of (configuration, mean KL, median KL, p99 KL, max KL, top-1 %, PPL); the
    reference's own PPL is the last row."""
    tokens = np.asarray(tokens, np.int64)
    t0 = time.perf_counter()
    ref = ref or Reference(path)
    H = ref.hidden(tokens)
    log(f"reference forward (float64): {time.perf_counter() - t0:.1f} s")
    configs = {}
    for n in names:
        try:
            configs[n] = make_config(n, path, len(tokens), threads)
        except Exception as e:     # e.g. no VNNI for int8 tiles: say so, measure the rest
            log(f"{n}: not measured ({type(e).__name__}: {e})")
    tallies = {n: Tally(LABELS.get(n, n)) for n in configs}
    ref_nll = []
    spent = {n: 0.0 for n in configs}
    for a in range(0, len(tokens), chunk):
        b = min(a + chunk, len(tokens))
        rl = ref.logits(H[a:b])
        targets = tokens[a + 1:b + 1]
        lr = log_softmax(rl[:len(targets)])
        ref_nll.append(-lr[np.arange(len(targets)), targets])
        del lr
        for n, c in configs.items():
            t = time.perf_counter()
            lg = c.logits(tokens, a, b)
            spent[n] += time.perf_counter() - t
            tallies[n].add(rl, lg, targets)
        log(f"positions {b}/{len(tokens)}")
    for c in configs.values():
        c.close()
    rows = [tallies[n].row() + [spent[n]] for n in configs]
    rows.append(["reference (float64)", 0.0, 0.0, 0.0, 0.0, 100.0,
                 float(np.exp(np.concatenate(ref_nll).mean())), float("nan")])
    return rows


HEADER = ["configuration", "mean KL", "median KL", "p99 KL", "max KL", "top-1 %", "PPL",
          "time s"]


def text_tokens(path: str, limit: int | None) -> list[int]:
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    gf = read_gguf(path)
    try:
        tok = Tokenizer.from_gguf(gf.metadata)
    finally:
        gf.close()
    ids = tok.encode("".join(TEXT), add_special=True, parse_special=False)
    return ids[:limit] if limit else ids


def main(argv=None) -> None:
    from common import model_path, setup_env, table
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=0, help="first N tokens of the text (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="int8,float,f32,torch,llamacpp-batch,llamacpp-token")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args(argv)
    setup_env(args.threads)
    os.environ.setdefault("EDGEINFER_THREADS", str(args.threads))
    import edgeinfer  # noqa: F401
    path = model_path(args.model)
    tokens = text_tokens(path, args.tokens or None)
    print(f"{Path(path).name}: {len(tokens)} tokens of text, CHUNK {CHUNK}")
    rows = measure(path, tokens, args.configs.split(","), args.threads)
    out = table(f"KL divergence from the float64 reference, {len(tokens)} positions "
                f"({Path(path).name})", HEADER, rows)
    print(out)
    if args.markdown:
        Path(args.markdown).write_text(out + "\n")


if __name__ == "__main__":
    main()
