"""Tokenizer speed beside llama.cpp's, same process, same text.

    .venv/bin/python benchmarks/tokenizer.py [model.gguf ...]

Defaults: the bundled gemma3 (/tmp/gemma3.gguf or the test cache) and llama.cpp's llama-bpe and
qwen2 vocab GGUFs from tests/data/fetch_llama_vocab.sh. Prints build time, cold (empty word
cache) and warm encode time of ~1,000 words, and llama.cpp's encode time on the same text.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.formats.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
VOCAB = Path(os.environ.get("EDGEINFER_TEST_DATA", REPO / ".cache" / "llama-vocab"))


def _text(words: int = 1000) -> str:
    src = ""
    for p in (REPO / "README.md", Path("/work/shared/DESIGN.md"), REPO / "edgeinfer" / "chat_template.py"):
        if p.exists():
            src += p.read_text("utf-8") + "\n"
    src += "naïve café 日本語のテキスト 🎉 "  # a little non-ASCII
    ws = src.split(" ")
    while len(ws) < words:
        ws += ws
    return " ".join(ws[:words])


def _best(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(path: str) -> None:
    text = _text()
    md = read_gguf(path).metadata
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(md)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = tok.encode(text)
    cold = time.perf_counter() - t0
    warm = _best(lambda: tok.encode(text))
    line = (f"{Path(path).name:32s} vocab {tok.vocab_size:7d}  build {build * 1e3:7.1f} ms  "
            f"encode {len(text.split()):5d} words -> {len(ids):5d} ids: cold {cold * 1e3:6.1f} ms, "
            f"warm {warm * 1e3:6.1f} ms")
    try:
        import llama_cpp
        ll = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        raw = text.encode()
        ref = _best(lambda: ll.tokenize(raw, add_bos=True, special=True))
        same = ll.tokenize(raw, add_bos=True, special=True) == ids
        ll.close()
        line += f"; llama.cpp {ref * 1e3:6.1f} ms (ids equal: {same}), ratio warm {warm / ref:4.2f}x"
    except ImportError:
        pass
    print(line)


def main(argv: list[str]) -> None:
    paths = argv or [p for p in ("/tmp/gemma3.gguf",
                                 str(REPO / ".cache" / "test-models" / "gemma-3-270m-q4_k_m.gguf"),
                                 str(VOCAB / "ggml-vocab-llama-bpe.gguf"),
                                 str(VOCAB / "ggml-vocab-qwen2.gguf"),
                                 str(VOCAB / "ggml-vocab-llama-spm.gguf")) if os.path.exists(p)]
    for p in paths:
        bench(p)


if __name__ == "__main__":
    main(sys.argv[1:])
