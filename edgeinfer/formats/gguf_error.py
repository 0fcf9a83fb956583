"""GGUFError on its own: what the CLI and the store catch, without the reader's numpy and
gguf imports (a tenth of a second of every `edgeinfer` command's start)."""


class GGUFError(ValueError):
    """A file that is not a usable GGUF model. The message is one sentence for a person."""
