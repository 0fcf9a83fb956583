"""Phi-3 / Phi-3.5 / Phi-4-mini: fused attn_qkv and gate/up (ffn_up of 2 x n_ff rows), NeoX
rope over the first rope.dimension_count dims, LongRoPE short factors with its attn_factor.

The config (edgeinfer/formats/model_config.py) carries the switches; models/variants.py runs
them."""
from __future__ import annotations

from edgeinfer.models.variants import VariantModel


class Phi3Model(VariantModel):
    pass
