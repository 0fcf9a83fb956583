"""Mistral 3 text models (Ministral 3): the llama block with YaRN rope scaling and Llama 4
style attention temperature past the original context.

The config (edgeinfer/formats/model_config.py) carries the switches; models/variants.py runs
them."""
from __future__ import annotations

from edgeinfer.models.variants import VariantModel


class Mistral3Model(VariantModel):
    pass
