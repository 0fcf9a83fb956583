"""Qwen 2 / 2.5 and Qwen 3: the llama block with NeoX rope, q/k/v biases (qwen2) or per-head
QK-norm (qwen3). The config carries those switches, so the llama forward runs them as is."""
from __future__ import annotations

from edgeinfer.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    pass
