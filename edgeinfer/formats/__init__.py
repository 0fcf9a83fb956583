"""File formats: GGUF reading and validation, model config, tokenizers, chat templates."""
