"""Architectures, one file each, written against the backend ops interface."""
from __future__ import annotations

from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import Model


def build_model(cfg: ModelConfig, ops, gguf_file) -> Model:
    """Instantiate the forward pass for cfg.arch with weights from the GGUF file."""
    if cfg.arch == "gemma3":
        from edgeinfer.models.gemma3 import Gemma3Model
        return Gemma3Model(cfg, ops, gguf_file)
    if cfg.arch == "gemma-embedding":
        from edgeinfer.models.gemma_embedding import GemmaEmbeddingModel
        return GemmaEmbeddingModel(cfg, ops, gguf_file)
    if cfg.arch in ("bert", "nomic-bert"):
        from edgeinfer.models.bert import BertModel
        return BertModel(cfg, ops, gguf_file)
    if cfg.arch in ("qwen2", "qwen3"):
        from edgeinfer.models.qwen2 import Qwen2Model
        return Qwen2Model(cfg, ops, gguf_file)
    if cfg.arch == "phi3":
        from edgeinfer.models.phi3 import Phi3Model
        return Phi3Model(cfg, ops, gguf_file)
    if cfg.arch == "smollm3":
        from edgeinfer.models.smollm3 import SmolLM3Model
        return SmolLM3Model(cfg, ops, gguf_file)
    if cfg.arch == "mistral3":
        from edgeinfer.models.mistral3 import Mistral3Model
        return Mistral3Model(cfg, ops, gguf_file)
    if cfg.arch == "qwen3moe":
        from edgeinfer.models.qwen3moe import Qwen3MoeModel
        return Qwen3MoeModel(cfg, ops, gguf_file)
    if cfg.arch in ("qwen2moe", "dots1") or (cfg.arch == "llama" and cfg.n_expert):
        from edgeinfer.models.moe import MoeModel      # qwen2moe, dots1, Mixtral
        return MoeModel(cfg, ops, gguf_file)
    if cfg.arch == "gpt-oss":
        from edgeinfer.models.gpt_oss import GptOssModel
        return GptOssModel(cfg, ops, gguf_file)
    from edgeinfer.models.llama import LlamaModel
    return LlamaModel(cfg, ops, gguf_file)
