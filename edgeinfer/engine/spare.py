"""A spare engine process, started ahead of the next model load.

A fresh engine process spends about half a second of a load before it reads a weight:
Python's and numba's imports, numba's runtime start-up, and loading each kernel from numba's
disk cache (~1-2 ms each without their bitcode, edgeinfer/numba_cache.py; ~12 before a first
token), then a first step that touches every page. A spare does that while the daemon waits:
it imports the engine, then loads from numba's cache the kernels of a hint model (the last
model the daemon loaded, else the bundled default), and waits for a model to serve. A load
takes it (`RemoteEngine(spare=...)`) and the daemon starts the next spare only once that
load is ready, so a spare never competes with a load for the cores.

Only kernels that an install, pull or earlier load compiled are loaded here (their warm-up
markers are set): compiling holds the GIL for minutes, and that stays the load's job, with
progress (edgeinfer.engine.warmup.prepare_for_load). Then the spare parses the hint's GGUF
header (kept for the load's memory estimate) and reads its vocabulary as the daemon would,
pickled: a load of that model sends it to the daemon first ("vocabulary"), which unpickles
it in ~0.13 s instead of reading it in ~0.4 s (Qwen2.5's 151k tokens; with the weights
mapped from the repack cache, that read was the longest part of a load). A load that
arrives while the spare is still warming takes it at the next step. The spare costs one
idle process (~250 MB resident with Qwen2.5-Coder 0.5B as the hint: numba's runtime and
kernels, the parsed header, the pickled vocabulary); EDGEINFER_SPARE_RUNNER=0 turns it off.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger("edgeinfer.engine.spare")


@dataclass
class Spare:
    """A started spare: its process, the daemon's end of its pipe, the model it warms."""
    process: mp.process.BaseProcess
    conn: object
    hint: str | None = None

    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        try:
            self.conn.send(("close",))
        except (OSError, EOFError, BrokenPipeError, ValueError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def spare_main(conn, hint: str | None, log_level: int) -> None:
    """The spare process: warm, then serve the model the daemon sends (or end on close)."""
    from edgeinfer.engine.remote import serve   # lazy: the daemon starts spares before its
                                                # own imports (server/daemon.py early_spare)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[runner "
                        f"{os.getpid()}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the daemon's to handle
    logging.getLogger("gguf").setLevel(logging.WARNING)  # the warm-up's tiny model's writer
    vocabulary = _warm(conn, hint)
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return
    if msg[0] != "serve":
        return
    _, path, config, mmproj, level, name = msg
    # the daemon's tokenizer and metadata, when this is the model warmed (else it reads them)
    conn.send(("vocabulary", vocabulary if path == hint else None))
    del vocabulary
    logging.getLogger().setLevel(level)
    serve(conn, path, config, mmproj, level, name)


def _warm(conn, hint: str | None) -> bytes | None:
    """Load the hint model's compiled kernels from numba's cache, a warm-up step at a time,
    then read its vocabulary as the daemon would, until a model arrives; returns that
    vocabulary pickled (RemoteEngine.read_vocabulary's tokenizer and metadata) if it got
    that far. Never fails the spare: a step that breaks is logged and skipped (the load
    then meets that kernel on first use, and the daemon reads the vocabulary itself)."""
    if hint is None:
        return None
    from edgeinfer.engine import warmup     # lazy: numba's runtime starts here
    from edgeinfer.engine.remote import RemoteEngine
    from edgeinfer.formats.gguf_file import remember_headers
    # the hint's header parsed once, here: a load of that model (the usual next one) skips
    # the parse (~0.1 s for a 150k vocabulary); serve() forgets it if another model comes
    remember_headers(compiled_walk=True)
    try:
        keys = warmup.keys_for_model(hint)
    except Exception as e:      # noqa: BLE001 - a hint that went away or broke
        log.info("spare: no kernels warmed (%s)", e)
        return None
    for key in keys:
        if conn.poll():         # a model is waiting: serve it now
            return None
        if not warmup.is_done(key):
            continue            # not compiled yet: the load compiles it, with progress
        try:
            warmup.run_step(key)
        except Exception as e:  # noqa: BLE001
            log.warning("spare: warm-up step %s failed (%s)", key, e)
    if conn.poll():
        return None
    try:    # ~0.4 s for a 150k vocabulary; the daemon unpickles it in ~0.13 s
        return pickle.dumps(RemoteEngine.read_vocabulary(hint), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:      # noqa: BLE001 - the daemon reads it then
        log.info("spare: vocabulary not read ahead (%s)", e)
        return None


class SpareRunner:
    """The daemon's one spare (or none). `take()` hands it to a load; `refill(hint)` starts
    the next one. Any thread may call these (loads run in worker threads)."""

    def __init__(self, enabled: bool, log_level: int):
        self.enabled = enabled
        self.log_level = log_level
        self._lock = threading.Lock()
        self._spare: Spare | None = None
        self._closed = False

    def wanted(self) -> bool:
        """Spares are on and none is there (or the last one died idle)."""
        with self._lock:
            return (self.enabled and not self._closed
                    and (self._spare is None or not self._spare.alive()))

    def refill(self, hint: str | None) -> None:
        """Start a spare warming `hint`'s kernels, unless one is there (or spares are off)."""
        with self._lock:
            if not self.enabled or self._closed:
                return
            if self._spare is not None:
                if self._spare.alive():
                    return
                self._spare.conn.close()     # died idle (an OOM kill): start another
            ctx = mp.get_context("spawn")     # never forked: see edgeinfer.engine.remote
            conn, child = ctx.Pipe()
            process = ctx.Process(target=spare_main, name="edgeinfer-spare", daemon=True,
                                  args=(child, hint, self.log_level))
            process.start()
            child.close()
            self._spare = Spare(process, conn, hint)
            log.debug("spare engine process %d started (hint %s)", process.pid, hint)

    def pid(self) -> int | None:
        """The waiting spare's process id (None: none waits)."""
        spare = self._spare
        return spare.process.pid if spare is not None and spare.alive() else None

    def hint(self) -> str | None:
        """The model file the waiting spare warms (None: none, or no hint)."""
        spare = self._spare
        return spare.hint if spare is not None else None

    def take(self) -> Spare | None:
        """The spare, now the caller's (None if there is none or it died)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and not spare.alive():
            spare.conn.close()
            return None
        return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
