"""The WordPiece tokenizer (`tokenizer.ggml.model = bert`) against llama.cpp: the ids of
llama.cpp's own bert-bge vocabulary test file (.inp/.out), and llama-cpp-python's tokenize()
on a mixed corpus with and without special tokens."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from edgeinfer.formats.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
VOCAB = Path(os.environ.get("EDGEINFER_TEST_DATA", REPO / ".cache" / "llama-vocab")) / \
    "ggml-vocab-bert-bge.gguf"
pytestmark = pytest.mark.skipif(not VOCAB.exists(), reason=f"{VOCAB} not prepared (install.sh)")

CORPUS = ["Hello world", " Hello, World!", "naïve café résumé Ünïcödé ÄÖÜäöüß", "日本語のテキスト、中文字符。",
          "emoji 🎉🦙 ok", "I'm you're WE'LL", "1234567890 3.14159 -42 1,000,000",
          "\u00a0nbsp\u3000ideographic", "\x00\x01\x1f control", "[CLS] x [SEP] y [MASK]",
          "https://example.com/a?b=c&d=e#f", "unaffable antidisestablishmentarianism",
          "Привет, как дела? Ελληνικά.", "x" * 300, "", "   ", "\t\n"]


@pytest.fixture(scope="module")
def pair():
    import llama_cpp
    llm = llama_cpp.Llama(str(VOCAB), vocab_only=True, verbose=False)
    yield Tokenizer.from_file(VOCAB), llm
    llm.close()


def test_llamacpp_vocab_test_file():
    tok = Tokenizer.from_file(VOCAB)
    texts = VOCAB.with_suffix(".gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    ids = VOCAB.with_suffix(".gguf.out").read_text("utf-8").split("\n")
    assert len(texts) > 40
    for text, want in zip(texts, ids):
        assert tok.encode(text, add_special=False, parse_special=False) == \
            [int(t) for t in want.split()], text


@pytest.mark.parametrize("add_special,parse_special", [(True, True), (False, False), (True, False)])
def test_matches_llamacpp_tokenize(pair, add_special, parse_special):
    tok, llm = pair
    rnd = random.Random(7)
    doc = "".join(CORPUS)
    snippets = CORPUS + [doc[i:i + rnd.randrange(1, 80)] for i in
                         (rnd.randrange(len(doc)) for _ in range(60))]
    for text in snippets:
        want = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        assert tok.encode(text, add_special, parse_special) == want, repr(text)


def test_cls_and_sep_around_the_text():
    tok = Tokenizer.from_file(VOCAB)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_id == 101 and ids[-1] == tok.sep_id == 102
    assert tok.add_sep
