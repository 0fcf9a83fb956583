"""Python's cyclic garbage collector while a process loads a model: held off, then frozen.

Importing numba and loading a model's kernels leave ~140k container objects that live as
long as the process, and every full collection walks all of them: a cold `edgeinfer run
--no-daemon` paid ~110 ms to the collector before its first token (two full collections of
18 and 52 ms, ~300 younger ones). Loading makes little cyclic garbage (~1.1k objects for
the 0.5B chat model), so the process that loads a model holds collection off from its start
(`hold`) until the engine is loaded (`release`), then `gc.freeze()`s everything alive:
later collections skip those objects, which also keeps full-collection pauses out of decode
steps. Kernels that compile for the load do so in child processes (engine/warmup.py), not
under the hold.

Only a process's own entry point holds (the CLI's `run`, an engine process): release()
does nothing where hold() did not run, so a library user's or a test's process keeps its
collector as it was (freezing there could pin garbage cycles still waiting for collection).
"""
from __future__ import annotations

import gc

_held = False       # hold() turned the collector off, and release() has not run since


def hold() -> None:
    """No automatic collection until release() (if the collector is on at all)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """The model is loaded: freeze what is alive and collect again, if hold() held."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()
