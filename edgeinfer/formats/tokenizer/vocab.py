"""The tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.

Behaviour follows llama.cpp's llama_vocab (the oracle our tests compare against): special and
user-defined tokens are cut out of the text first (longest first), the remaining fragments go
through SentencePiece (`llama`) or byte-level BPE (`gpt2`), and BOS/EOS are added as the
vocabulary asks.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Collection, Iterable

import numpy as np
import regex

from ..gguf_file import read_gguf
from . import bpe, pretokenize, spm, wpm
from .spm import TokenizerError

log = logging.getLogger(__name__)


class TokenType(IntEnum):
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token texts llama.cpp treats as ending generation (llama-vocab.cpp, special_eog_ids).
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
              "<end_of_utterance>")
# llama.cpp's fill-in-the-middle guesses by text, per kind; a found token becomes a control token
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# gpt-oss: these are rendered as text by llama.cpp
_USER_DEFINED_OVERRIDE = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    eot: int | None
    eom: int | None
    fim_pre: int | None = None
    fim_suf: int | None = None
    fim_mid: int | None = None
    fim_pad: int | None = None
    fim_rep: int | None = None
    fim_sep: int | None = None


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    encode(text, add_special=True, parse_special=True) matches llama.cpp's
    llama_tokenize(text, add_special, parse_special) id for id.
    """

    def __init__(self, *, model: str, pre: str, tokens: list[str], scores: np.ndarray,
                 types: np.ndarray, merges: list[str], special: SpecialIds, add_bos: bool,
                 add_eos: bool, add_space_prefix: bool, rstrip_specials: bool = False):
        self.model = model
        self.pre = pre
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.special = special
        self.bos_id = special.bos
        self.eos_id = special.eos
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.sep_id: int | None = None      # bert: [SEP], appended after the text
        self.add_sep = False
        self.add_space_prefix = add_space_prefix
        # last one wins for duplicate texts, as in llama.cpp's token_to_id
        self.token_to_id: dict[str, int] = dict(zip(tokens, range(len(tokens))))
        types = types.astype(np.int32, copy=True)
        self._fix_types(types)
        self.types = types
        self.eot_ids = self._eog_ids()
        # Control / user-defined / unknown tokens, longest text first (llama.cpp's order).
        is_sp = np.isin(types, (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN))
        sp_ids = np.nonzero(is_sp)[0]
        sp_ids = sorted(sp_ids.tolist(), key=lambda i: -len(tokens[i].encode("utf-8",
                                                                            "surrogateescape")))
        self._special_order = sp_ids
        self._special_rank = {tid: r for r, tid in enumerate(sp_ids)}
        self._special_ids_by_text: dict[str, list[int]] = {}
        for i in sp_ids:
            self._special_ids_by_text.setdefault(tokens[i], []).append(i)
        self._special_lens = self._special_index(sp_ids)
        self._special_first = self._special_scanner(sp_ids)
        # phi-3: llama.cpp strips whitespace after most special tokens
        self._rstrip_ids = frozenset(i for i in sp_ids if tokens[i] not in
                                     ("<unk>", "<s>", "<|endoftext|>")) if rstrip_specials \
            else frozenset()
        if rstrip_specials and "</s>" in self.token_to_id:
            self._rstrip_ids |= {self.token_to_id["</s>"]}
        # every id's bytes, built on first use of the whole table (grammars, stop strings):
        # one token's bytes come from piece() without it, so a load does not wait for them
        self._token_bytes: list[bytes] | None = None
        self._special_bytes: list[bytes] | None = None
        if model == "llama":
            # <0xNN>, else the one-byte token itself (llama.cpp's byte_to_token)
            t2i = self.token_to_id
            byte_ids = [t2i.get(f"<0x{b:02X}>", t2i.get(chr(b) if b < 0x80 else chr(0xDC00 + b)))
                        for b in range(256)]
            self._enc: Any = spm.SpmEncoder(self.token_to_id, scores.astype(np.float64).tolist(),
                                            byte_ids, self.vocab_size)
        elif model == "bert":
            self._enc = wpm.WpmEncoder(self.token_to_id, special.unk, True, True)
        else:
            self._enc = bpe.BpeEncoder(self.token_to_id, merges, pre,
                                       byte_encode=(model == "gpt2"))

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build from a GGUF metadata dict (edgeinfer.formats.gguf_file.read_gguf(path).metadata)."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise TokenizerError("the model file has no tokenizer vocabulary "
                                 "(tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        if model not in ("llama", "gpt2", "gemma4", "bert"):
            raise TokenizerError(f"tokenizer type {model!r} is not supported (supported: "
                                 f"llama/SentencePiece, gpt2/byte-level BPE, gemma4, "
                                 f"bert/WordPiece)")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is not a non-empty list of strings")
        n = len(tokens)
        if "" in tokens:        # one C-level scan; the rebuild only for such vocabularies
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        scores = np.asarray(metadata.get("tokenizer.ggml.scores", np.zeros(n, np.float32)))
        types = np.asarray(metadata.get("tokenizer.ggml.token_type",
                                        np.full(n, TokenType.NORMAL, np.int32)))
        if len(scores) < n or len(types) < n:
            raise TokenizerError(f"tokenizer has {n} tokens but only {len(scores)} scores and "
                                 f"{len(types)} token types")
        merges = metadata.get("tokenizer.ggml.merges") or []
        if model not in ("llama", "bert") and not merges:
            raise TokenizerError("a BPE tokenizer needs tokenizer.ggml.merges, which is missing")
        pre = "gemma4" if model == "gemma4" else str(metadata.get("tokenizer.ggml.pre") or "default")
        if model == "gpt2" and not pretokenize.is_known(pre):
            log.warning("pre-tokenizer %r is not known here; using the gpt-2 split", pre)

        def tid(key: str, default: int | None) -> int | None:
            # llama.cpp: an id outside the vocabulary falls back to the default, if that fits
            if default is not None and not 0 <= default < n:
                default = None
            v = metadata.get(f"tokenizer.ggml.{key}")
            try:
                v = int(v) if v is not None else None
            except (TypeError, ValueError):
                v = None
            return v if v is not None and 0 <= v < n else default

        if model == "llama":
            special = SpecialIds(bos=tid("bos_token_id", 1), eos=tid("eos_token_id", 2),
                                 unk=tid("unknown_token_id", 0), pad=tid("padding_token_id", None),
                                 eot=tid("eot_token_id", None), eom=tid("eom_token_id", None))
            add_bos, add_eos, space = True, False, True
        elif model == "bert":
            # llama.cpp's WPM defaults: [CLS] 101 as BOS, [SEP] 102 after, [UNK] 100
            special = SpecialIds(bos=tid("bos_token_id", tid("cls_token_id", 101)),
                                 eos=tid("eos_token_id", None),
                                 unk=tid("unknown_token_id", 100),
                                 pad=tid("padding_token_id", 0), eot=None, eom=None)
            add_bos, add_eos, space = True, False, False
        else:
            dflt = 11 if model == "gpt2" else None
            special = SpecialIds(bos=tid("bos_token_id", dflt), eos=tid("eos_token_id", dflt),
                                 unk=tid("unknown_token_id", None),
                                 pad=tid("padding_token_id", None),
                                 eot=tid("eot_token_id", None), eom=tid("eom_token_id", None))
            add_bos = pre in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                              "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon")
            add_eos, space = False, False
        if model == "gpt2" and pre in ("chatglm-bpe", "glm4", "glm5"):
            special = replace(special, bos=None)

        def either(old: str, new: str) -> int | None:
            v = tid(old, None)          # llama.cpp reads the deprecated key last
            return v if v is not None else tid(new, None)

        fim = {"fim_pre": either("prefix_token_id", "fim_pre_token_id"),
               "fim_suf": either("suffix_token_id", "fim_suf_token_id"),
               "fim_mid": either("middle_token_id", "fim_mid_token_id"),
               "fim_pad": tid("fim_pad_token_id", None), "fim_rep": tid("fim_rep_token_id", None),
               "fim_sep": tid("fim_sep_token_id", None)}
        special = replace(special, **fim)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", add_eos))
        if pre == "gemma4":
            add_bos = True          # llama.cpp overrides it for Gemma 4
        if model == "llama":
            space = bool(metadata.get("tokenizer.ggml.add_space_prefix", space))
        name = str(metadata.get("general.name", "")).lower()
        tok = cls(model=model, pre=pre, tokens=tokens, scores=scores[:n], types=types[:n],
                  merges=list(merges), special=special, add_bos=add_bos, add_eos=add_eos,
                  add_space_prefix=space,
                  rstrip_specials=("phi-3" in name or "phi3" in name))
        if model == "bert":
            tok.sep_id = tid("seperator_token_id", 102)       # sic: llama.cpp's key
            tok.add_sep = bool(metadata.get("tokenizer.ggml.add_sep_token", True))
            lower = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
            strip = bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lower))
            tok._enc = wpm.WpmEncoder(tok.token_to_id, special.unk, lower, strip)
        return tok

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF file's metadata (raises GGUFError / TokenizerError)."""
        f = read_gguf(path)
        try:
            return cls.from_gguf(f.metadata)
        finally:
            f.close()

    def _fix_types(self, types: np.ndarray) -> None:
        """llama.cpp's text-based fix-ups of token attributes (llama_vocab::load)."""
        t2i = self.token_to_id
        sp = self.special
        found: dict[str, int] = {}

        def guess(kind: str, texts: tuple[str, ...]) -> None:
            if getattr(sp, kind) is not None:
                return
            for text in texts:
                i = t2i.get(text)
                if i is not None:
                    found[kind] = i
                    _make_control(types, i)
                    return

        guess("eot", _EOT_TEXTS)
        guess("eom", ("<|eom_id|>",))
        for kind, texts in _FIM_TEXTS.items():
            guess(kind, texts)
        if found:
            self.special = sp = replace(sp, **found)
        for text in _EOG_TEXTS:
            i = t2i.get(text)
            if i is not None:
                _make_control(types, i)
        for text in _USER_DEFINED_OVERRIDE:
            i = t2i.get(text)
            if i is not None:
                types[i] = TokenType.USER_DEFINED

    def _eog_ids(self) -> frozenset[int]:
        t2i = self.token_to_id
        sp = self.special
        ids = {t2i[t] for t in _EOG_TEXTS if t in t2i}
        for i in (sp.eos, sp.eot, sp.eom, sp.fim_pad, sp.fim_rep, sp.fim_sep):
            if i is not None:
                ids.add(i)
        texts = {self.tokens[i]: i for i in ids}
        # llama.cpp's workarounds: harmony / solar-open "<|end|>" and gemma4's "</s>" are text
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or
                                                             "<|calls|>" in texts)) or
                                   ("<|flush|>" in texts and ("<|call|>" in texts or
                                                              "<|calls|>" in texts))):
            ids.discard(texts["<|end|>"])
            self.types[texts["<|end|>"]] = TokenType.USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            ids.discard(texts["</s>"])
            self.types[texts["</s>"]] = TokenType.NORMAL
        return frozenset(ids)

    def _special_index(self, sp_ids: list[int]) -> dict[str, tuple[int, ...]]:
        """First character -> the distinct lengths of special texts starting with it."""
        lens: dict[str, set[int]] = {}
        for i in sp_ids:
            t = self.tokens[i]
            lens.setdefault(t[0], set()).add(len(t))
        return {c: tuple(sorted(v)) for c, v in lens.items()}

    def _piece_bytes(self, render_special: bool) -> list[bytes]:
        """Bytes each id stands for, as llama.cpp's token_to_piece(id, special)."""
        toks, types = self.tokens, self.types
        n = len(toks)
        if self.model in _SPACE_ESCAPED:
            joined = "\x00".join(toks)
            pieces = joined.replace(spm.SPACE, " ").encode("utf-8", "surrogateescape").split(b"\x00")
            if len(pieces) != n:
                pieces = [_escaped_piece(t) for t in toks]
        else:
            pieces = self._bytelevel_pieces()
        out = list(pieces)
        for i in np.nonzero(types != TokenType.NORMAL)[0].tolist():
            out[i] = _typed_piece(toks[i], int(types[i]), render_special)
        return out

    def _one_piece(self, i: int, render_special: bool) -> bytes:
        """_piece_bytes(render_special)[i], without building the list."""
        t = self.tokens[i]
        kind = int(self.types[i])
        if kind != TokenType.NORMAL:
            return _typed_piece(t, kind, render_special)
        if self.model in _SPACE_ESCAPED:
            return _escaped_piece(t)
        x = t.translate(_GPT2_TO_BYTE)
        if _NOT_LATIN1.search(x):       # outside the byte alphabet: kept as UTF-8
            return t.encode("utf-8", "surrogateescape")
        return x.encode("latin-1")

    def _bytelevel_pieces(self) -> list[bytes]:
        toks = self.tokens
        # One translate and encode for the whole vocabulary: each character becomes one
        # character and then one byte, so token i's bytes are at its characters' offsets (a
        # separator would not do: the alphabet has a character for byte 0). Tokens with
        # characters outside the byte alphabet (added tokens: llama.cpp writes a marker, we
        # keep their UTF-8) are found by position and done one by one.
        text = "".join(toks).translate(_GPT2_TO_BYTE)
        data = text.encode("latin-1", errors="replace")
        ends = list(itertools.accumulate(map(len, toks)))
        pieces = [data[a:b] for a, b in zip([0] + ends[:-1], ends)]
        odd = [m.start() for m in _NOT_LATIN1.finditer(text)]
        if odd:
            for i in set(np.searchsorted(ends, odd, side="right").tolist()):
                pieces[i] = toks[i].encode("utf-8", "surrogateescape")
        return pieces

    # --- queries ---------------------------------------------------------------------------
    def is_special(self, token_id: int) -> bool:
        """Control or unknown token: not text, hidden when decoding."""
        return int(self.types[token_id]) in (TokenType.CONTROL, TokenType.UNKNOWN)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eot_ids

    def token_text(self, token_id: int) -> str:
        return self.tokens[token_id]

    def piece(self, token_id: int, render_special: bool = False) -> bytes:
        table = self._special_bytes if render_special else self._token_bytes
        if table is not None:
            return table[token_id]
        return self._one_piece(token_id, render_special)

    @property
    def token_bytes(self) -> list[bytes]:
        """Every id's bytes as llama.cpp's token_to_piece(id, special=False)."""
        return self.piece_table(False)

    def piece_table(self, render_special: bool = False) -> list[bytes]:
        """Every id's bytes (piece() of each), one list, for passes over the vocabulary."""
        # built at most once per thread that finds it missing; the lists are equal
        if render_special:
            if self._special_bytes is None:
                self._special_bytes = self._piece_bytes(render_special=True)
            return self._special_bytes
        if self._token_bytes is None:
            self._token_bytes = self._piece_bytes(render_special=False)
        return self._token_bytes

    # --- encode ----------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               as_text: Collection[int] = ()) -> list[int]:
        """`as_text`: special-token ids never cut out of the text, whatever their type (the
        grammar engine's view, where a user-defined chat tag is not text a model may write)."""
        text = _clean_surrogates(text)
        out: list[int] = []
        fragments = self._partition(text, parse_special, as_text) if text else []
        if self.model == "bert":
            # llama.cpp's WPM: [CLS] text [SEP] whenever specials are added
            if add_special and self.bos_id is not None:
                out.append(self.bos_id)
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._enc.encode(frag, out)
            if add_special and self.sep_id is not None:
                out.append(self.sep_id)
            return out
        if self.model == "llama":
            if add_special and self.add_bos and self.bos_id is not None:
                out.append(self.bos_id)
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._enc.encode(frag.replace(" ", spm.SPACE), out)
                prev_special = False
        else:
            if add_special and self.add_bos and self.bos_id is not None:
                out.append(self.bos_id)
            escape = self.model == "gemma4"        # SentencePiece-style BPE: spaces are U+2581
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._enc.encode(frag.replace(" ", spm.SPACE) if escape else frag, out)
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool,
                   as_text: Collection[int] = ()) -> list[str | int]:
        """Cut special tokens out of the text exactly as llama.cpp's tokenizer_st_partition."""
        if self._special_first is None:
            return [text]
        cands = self._candidates(text)
        if not cands:
            return [text]
        types = self.types
        frags: list[str | int] = [text]
        for tid in cands:
            if not parse_special and int(types[tid]) in (TokenType.CONTROL, TokenType.UNKNOWN):
                continue
            if tid in as_text:
                continue
            ttext = self.tokens[tid]
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or ttext not in frag:
                    new.append(frag)
                    continue
                pos = 0
                while True:
                    m = frag.find(ttext, pos)
                    if m < 0:
                        if pos < len(frag):
                            new.append(frag[pos:])
                        break
                    if m > pos:
                        new.append(frag[pos:m])
                    new.append(tid)
                    pos = m + len(ttext)
                    if tid in self._rstrip_ids:
                        while pos < len(frag) and frag[pos] in " \t\n\v\f\r":
                            pos += 1
            frags = new
        return frags

    def _special_scanner(self, sp_ids: list[int]) -> "regex.Pattern | None":
        """A regex that stops at every place a special token may start.

        Characters whose special tokens are all runs of themselves (gemma's "\\n\\n\\n",
        spaces, tabs) match as whole runs, so a run is looked at once, not at every position.
        """
        if not self._special_lens:
            return None
        runs = {c for c in self._special_lens}
        for i in sp_ids:
            t = self.tokens[i]
            if t.strip(t[0]):
                runs.discard(t[0])
        self._special_runs = frozenset(runs)
        single = [c for c in self._special_lens if c not in runs]
        alts = [regex.escape(c) + "+" for c in sorted(runs)]
        if single:
            alts.append("[" + "".join(regex.escape(c) for c in single) + "]")
        return regex.compile("|".join(alts))

    def _candidates(self, text: str) -> list[int]:
        """Special tokens that occur in `text`, in llama.cpp's processing order."""
        found: set[int] = set()
        by_text = self._special_ids_by_text
        lens = self._special_lens
        runs = self._special_runs
        for m in self._special_first.finditer(text):
            s = m.group()
            c = s[0]
            if c in runs:
                # a run of length L holds every shorter run token of that character
                for k in lens[c]:
                    if k > len(s):
                        break
                    ids = by_text.get(s[:k])
                    if ids is not None:
                        found.update(ids)
                continue
            p = m.start()
            for k in lens[c]:
                ids = by_text.get(text[p:p + k])
                if ids is not None:
                    found.update(ids)
        rank = self._special_rank
        return sorted(found, key=rank.__getitem__)

    # --- decode ----------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int], render_special: bool = False) -> bytes:
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        if len(ids) < 4096:         # not worth building the whole table for
            return b"".join([self.piece(i, render_special) for i in ids])
        table = self.piece_table(render_special)
        return b"".join([table[i] for i in ids])

    def decode(self, ids: Iterable[int], render_special: bool = False) -> str:
        """Text of `ids`; special tokens hidden unless render_special; bad UTF-8 -> U+FFFD.

        With a SentencePiece space prefix, the space encode() put before the first word is
        taken off again, so decode(encode(t)) == t.
        """
        ids = list(ids)
        data = self.decode_bytes(ids, render_special)
        if self.add_space_prefix and data[:1] == b" ":
            for i in ids:
                if self.piece(i, render_special):
                    if int(self.types[i]) == TokenType.NORMAL:
                        data = data[1:]
                    break
        return data.decode("utf-8", "replace")


def _make_control(types: np.ndarray, i: int) -> None:
    # llama.cpp ORs in the CONTROL attribute; byte and unknown tokens keep what they are
    if types[i] not in (TokenType.BYTE, TokenType.UNKNOWN):
        types[i] = TokenType.CONTROL


# SentencePiece-style vocabularies: U+2581 stands for a space
_SPACE_ESCAPED = ("llama", "gemma4", "bert")


def _escaped_piece(text: str) -> bytes:
    return text.replace(spm.SPACE, " ").encode("utf-8", "surrogateescape")


def _typed_piece(text: str, kind: int, render_special: bool) -> bytes:
    """The bytes of a token that is not NORMAL, as llama.cpp's token_to_piece."""
    if kind == TokenType.BYTE:
        return _byte_token_value(text)
    if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
        return text.encode("utf-8", "surrogateescape") if render_special else b""
    if kind == TokenType.USER_DEFINED:
        return text.encode("utf-8", "surrogateescape")
    return b""          # unused / undefined: llama.cpp prints nothing


def _byte_token_value(text: str) -> bytes:
    # "<0xNN>"
    try:
        return bytes([int(text[3:5], 16)])
    except ValueError:
        return b""


_NOT_LATIN1 = regex.compile("[^\x00-\xff]")
# GPT-2 byte-alphabet character -> the byte it stands for, for str.translate
_GPT2_TO_BYTE = {ord(c): b for c, b in bpe.CHAR_TO_BYTE.items()}


def _clean_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
