"""SmolLM3: the llama block without rope on every fourth layer (NoPE layers; llama.cpp
hard-codes n_no_rope_layer_step = 4).

The config (edgeinfer/formats/model_config.py) carries the switches; models/variants.py runs
them."""
from __future__ import annotations

from edgeinfer.models.variants import VariantModel


class SmolLM3Model(VariantModel):
    pass
