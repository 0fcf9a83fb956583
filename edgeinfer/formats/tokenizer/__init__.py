"""Tokenizers built from GGUF vocabularies (SentencePiece and byte-level BPE), matching
llama.cpp id for id, and an incremental UTF-8-safe detokenizer for streaming."""
from .detokenize import IncrementalDetokenizer
from .vocab import SpecialIds, Tokenizer, TokenizerError, TokenType

__all__ = ["IncrementalDetokenizer", "SpecialIds", "Tokenizer", "TokenizerError", "TokenType"]
