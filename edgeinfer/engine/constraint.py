"""What the engine needs of a per-request token constraint (structured output, tools).

A request may carry one `TokenConstraint`. Before each step in which the request samples,
the engine asks it for the allowed next tokens and puts that mask in the step plan; the
runner's sampler applies it (masked tokens get -inf). After the step the engine reports the
sampled token with `accept`. Implementations wrap a grammar engine's matcher; the engine
thread is the only caller.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class ConstraintError(RuntimeError):
    """The constraint cannot continue (a rejected token, an unsatisfiable grammar); the
    request ends with finish reason "error" and this message."""


class TokenConstraint(Protocol):
    def allowed_tokens(self) -> np.ndarray:
        """bool [vocab]: True where the next token may be sampled."""
        ...

    def accept(self, token: int) -> None:
        """Advance past a sampled token; raises ConstraintError if it was not allowed."""
        ...

    def is_complete(self) -> bool:
        """True once the grammar has matched in full: the request stops here."""
        ...
