"""One loaded model's engine in a process of its own.

The daemon keeps HTTP, templates and tokenization; the engine process (spawned, never
forked: numba's OpenMP runtime is not fork-safe) loads the runner and runs the Engine loop.
Over one pipe cross only plain data: requests as token ids and sampling parameters, grammar
specs (compiled again on the engine's side), image embeddings as arrays, and events back as
dicts of RequestOutput's fields. Unloading ends the process, so every page its runner,
kernels and libraries mapped goes back to the OS; a runner that dies (a crash in native
code, SIGKILL, an OOM kill) ends its requests with an error and takes nothing else with it.

Finishing (stop tokens and strings, length, grammar, repetition) is decided in one place,
the engine's FinishCheck, so detokenization for stop strings runs there too; the daemon
gets the text with each event.

`RemoteEngine` is the daemon's handle and has the Engine's client-side surface (submit,
abort, submit_embed, snapshot, prompts). `serve` is the engine process's main loop.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable

from edgeinfer import startup_gc
from edgeinfer.engine.core import Engine, EngineConfig, RequestOutput
from edgeinfer.engine.grammar import grammars_for
from edgeinfer.engine.images import Layout
from edgeinfer.engine.prompts import PromptMethods, Prompter, chat_format
from edgeinfer.engine.requests import EngineInfo, RequestError, check_embed, check_request
from edgeinfer.runners.base import start_thread
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.engine.warmup import Progress, prepare_for_load
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.formats.mmproj import read_mmproj
from edgeinfer.formats.tokenizer import Tokenizer

log = logging.getLogger("edgeinfer.engine.remote")

READY_TIMEOUT_S = 3600.0        # a load that compiles kernels may take minutes
_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))


class RunnerDied(RuntimeError):
    """The engine process is gone; requests on it end with this message."""


class LoadFailed(RuntimeError):
    """The engine process could not load the model (the message is the load's own)."""


# ----- the engine process ---------------------------------------------------------------------

def serve(conn, path: str, config: EngineConfig, mmproj: str | None, log_level: int,
          name: str = "") -> None:
    """The engine process: compile what kernels the model lacks (progress messages), load,
    say ready (or why not), then run commands until the daemon says close or its end of the
    pipe goes away."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[runner "
                        f"{os.getpid()}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the daemon's to handle
    startup_gc.hold()       # released once the engine is loaded (edgeinfer/startup_gc.py)
    from edgeinfer.runners.choice import estimate_memory  # lazy: the engine process's only
    from edgeinfer.formats.gguf_file import forget_headers, remember_headers
    # the estimate, the kernel steps and the runner read one parse (numba runs here anyway
    # on the cpu backend: its walk of the vocabulary); a spare's parse of another model goes
    remember_headers(compiled_walk=config.backend == "cpu")
    forget_headers(keep=path)
    t0 = time.perf_counter()
    try:    # the backend's own figures, for the daemon's memory budget, before any weight
        est = estimate_memory(config.backend, path, config.kv_cache_type, config.repack,
                              config.torch_dtype)
    except BaseException as e:      # noqa: BLE001 - the daemon reports it, in one sentence
        conn.send(("failed", type(e).__name__, str(e)))
        conn.close()
        return
    conn.send(("estimate", est))
    try:
        go = conn.recv()
    except (EOFError, OSError):
        return
    if go[0] != "load":             # the budget refused it
        return
    t1 = time.perf_counter()

    def progress(p) -> None:
        conn.send(("progress", p.done, p.total, p.label))
    prepare_for_load(path, config.backend, config.kv_cache_type, config.repack, progress, name)
    if config.backend == "cpu" or config.backend == "llamacpp":
        from edgeinfer.backends.threads import ThreadGovernor  # lazy: not in the daemon
        # this process's own budget: it measures the other engine processes as busy cores
        config = dataclasses.replace(config, governor=ThreadGovernor(fixed=config.threads))
    t2 = time.perf_counter()
    try:
        engine = Engine(path, config, mmproj=mmproj)
    except BaseException as e:      # noqa: BLE001 - the daemon reports it, in one sentence
        conn.send(("failed", type(e).__name__, str(e)))
        conn.close()
        return
    log.info("loaded %s in %.2f s (memory estimate %.2f s, kernels %.2f s, weights and KV "
             "pool %.2f s)%s", name or os.path.basename(path), time.perf_counter() - t0,
             t1 - t0, t2 - t1, time.perf_counter() - t2,
             _weights_note(engine) if config.backend == "cpu" else "")
    startup_gc.release()
    _EngineServer(conn, engine).run()


def _weights_note(engine: Engine) -> str:
    """Where a CPU load's repacked weights came from (the repack cache's figures)."""
    cache = engine.runner.ops.packed_cache
    if cache is None:
        return ""
    return f"; {cache.hits} matrices mapped from the repack cache, {cache.misses} repacked"


class _EngineServer:
    """The engine process's side of the pipe. The engine loop runs on the main thread, the
    one that loaded the model (and, in a spare, warmed the kernels): every thread that starts
    a parallel region gets an OpenMP team of its own that lives on, and with more OpenMP
    threads than cores libgomp throttles their spin-waiting, so each region of a decode step
    can pay a futex wake-up (the parallel repack runs on this thread too). A thread of its
    own reads the commands; both send (one lock orders the senders)."""

    def __init__(self, conn, engine: Engine):
        self.conn, self.engine = conn, engine
        self._send_lock = threading.Lock()
        self._ids: dict[int, int] = {}       # the daemon's request id -> the engine's

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                pass                # the daemon is gone: the read loop ends us

    def run(self) -> None:
        engine = self.engine
        engine.on_publish = self._published
        self.send(("ready", engine.info))
        threading.Thread(target=self._read, name="edgeinfer-pipe", daemon=True).start()
        try:
            engine.run_loop()
        finally:
            engine.close()
            self.send(("closed",))
            self.conn.close()

    def _read(self) -> None:
        """Commands until the daemon says close or its end of the pipe goes away; then the
        engine loop ends."""
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "close":
                    break
                self._handle(msg)
        finally:
            self.engine.stop()

    def _published(self, snap: dict) -> None:
        """Engine thread, after each step: the figures follow the step's events (one small
        dict; /api/stats reads them as of the last step, as in process)."""
        self.send(("snap", snap))

    def _sink(self, rid: int) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            d = {k: getattr(out, k) for k in _OUTPUT_FIELDS}
            d["request_id"] = rid
            if out.finished:
                self._ids.pop(rid, None)
            self.send(("out", rid, d))
        return sink

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        engine = self.engine
        if kind == "add":
            (_, rid, prompt, params, choice, spec, follows, prompt_logprobs, score_only,
             prediction, images) = msg
            sink = self._sink(rid)
            try:
                constraint = None
                if spec is not None:    # compiled again here, cached per model
                    constraint = grammars_for(engine.tokenizer,
                                              int(engine.cfg.vocab_size)).constraint(spec)
                kw = {"constraint": constraint, "prompt_logprobs": prompt_logprobs,
                      "score_only": score_only, "prediction": prediction, "images": images}
                if follows is not None and follows in self._ids:
                    kw["follows"] = self._ids[follows]
                self._ids[rid] = engine.submit(prompt, params, sink, choice=choice, **kw)
            except Exception as e:      # noqa: BLE001 - checked in the daemon already
                sink(RequestOutput(rid, finished=True, finish_reason="error", error=str(e),
                                   num_prompt_tokens=len(prompt), finish_time=time.monotonic()))
        elif kind == "embed":
            _, rid, prompt, pooling = msg
            sink = self._sink(rid)
            try:
                self._ids[rid] = engine.submit_embed(prompt, sink, pooling)
            except Exception as e:      # noqa: BLE001
                sink(RequestOutput(rid, finished=True, finish_reason="error", error=str(e),
                                   finish_time=time.monotonic()))
        elif kind == "abort":
            eid = self._ids.pop(msg[1], None)
            if eid is not None:
                engine.abort(eid)
        elif kind == "call":
            _, cid, name, args = msg
            try:
                self.send(("reply", cid, True, self._call(name, args)))
            except Exception as e:      # noqa: BLE001 - the caller raises it
                self.send(("reply", cid, False, (type(e).__name__, str(e))))

    def _call(self, name: str, args: tuple) -> Any:
        engine = self.engine
        if name == "encode_image":
            return engine.vision.encode(args[0])
        if name == "encode":
            return engine.tokenizer.encode(*args)
        if name == "piece":
            return engine.tokenizer.piece(*args)
        if name == "tokenizer_facts":
            t = engine.tokenizer
            return {k: getattr(t, k) for k in ("vocab_size", "model", "bos_id", "eos_id",
                                               "add_bos", "eot_ids")}
        raise ValueError(f"unknown call {name!r}")


# ----- the daemon's side ------------------------------------------------------------------------

class _RemoteTokenizer:
    """A vocabulary only llama.cpp reads (the llama.cpp backend's own tokenizer): encode and
    pieces are asked of the engine process, pieces cached."""

    def __init__(self, remote: "RemoteEngine"):
        self._remote = remote
        facts = remote.call("tokenizer_facts")
        self.__dict__.update(facts)
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._remote.call("encode", text, add_special, parse_special)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eot_ids

    def piece(self, token_id: int, render_special: bool = False) -> bytes:
        key = (token_id, render_special)
        p = self._pieces.get(key)
        if p is None:
            p = self._pieces[key] = self._remote.call("piece", token_id, render_special)
        return p

    def decode_bytes(self, ids, render_special: bool = False) -> bytes:
        return b"".join(self.piece(i, render_special) for i in ids)

    def decode(self, ids, render_special: bool = False) -> str:
        return self.decode_bytes(ids, render_special).decode("utf-8", errors="replace")


class RemoteEngine(PromptMethods):
    """A model whose engine runs in its own process. Construction spawns the process and
    returns with `estimate`, the backend's memory figures (edgeinfer.runners.choice
    .MemoryEstimate), before any weight is read; `load()` then loads (or `close()` gives
    up), blocking until the engine is ready (LoadFailed or MemoryError with the load's
    message otherwise); meanwhile the daemon reads the vocabulary and template."""

    def __init__(self, path: str, config: EngineConfig, mmproj: str | None = None,
                 on_death: Callable[["RemoteEngine"], None] | None = None,
                 progress: Callable[[Any], None] | None = None, name: str = "",
                 spare=None):
        self.path, self.config, self.mmproj = path, config, mmproj
        self.on_death = on_death
        self._progress = progress
        self._lock = threading.Lock()
        self._sinks: dict[int, Callable[[RequestOutput], None]] = {}
        self._calls: dict[int, list] = {}            # call id -> [Event, ok, value]
        self._ids = itertools.count(1)
        self._snapshot: dict[str, float] = {}
        self.dead: str | None = None                 # why the process is gone
        self._closing = False
        args = (path, dataclasses.replace(config, governor=None), mmproj,
                logging.getLogger("edgeinfer").getEffectiveLevel(), name)
        prepared = None
        if spare is not None:       # an edgeinfer.engine.spare.Spare: warm, waiting
            self.process, self._conn = spare.process, spare.conn
            try:
                self._conn.send(("serve", *args))
                # the vocabulary the spare read ahead, pickled, if it warmed this model
                prepared = self._wait_for("vocabulary")[1]
            except (OSError, EOFError, BrokenPipeError, ValueError):
                self._kill()
                raise LoadFailed("the spare engine process was gone") from None
            except BaseException:
                self._kill()
                raise
        else:
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self.process = ctx.Process(target=serve, name="edgeinfer-runner", daemon=True,
                                       args=(child, *args))
            self.process.start()
            child.close()
        # the daemon's own vocabulary and template, read while the engine process estimates
        # and loads (one core each at first); a spare's, unpickled once the load is asked
        # for (~0.13 s instead of ~0.4 s for Qwen2.5's 151k tokens, holding the GIL: not
        # while the daemon decides whether the model fits)
        self._vocabulary: concurrent.futures.Future | bytes = prepared if prepared is not None \
            else start_thread(self.read_vocabulary, path, name="edgeinfer-vocabulary")
        try:
            self.estimate = self._wait_for("estimate")[1]
        except BaseException:
            self._kill()
            raise

    def load(self, progress: Callable[[Progress], None] | None = None) -> "RemoteEngine":
        """Load the weights in the engine process; returns once it serves. `progress` gets
        the kernel compilation's steps first, if any are due."""
        mmproj = self.mmproj
        if progress is not None:
            self._progress = progress
        try:
            self._conn.send(("load",))
            if isinstance(self._vocabulary, bytes):     # the spare's, unpickled now
                self._vocabulary = start_thread(pickle.loads, self._vocabulary,
                                                name="edgeinfer-vocabulary")
            tokenizer, md = self._vocabulary.result()
            self.info: EngineInfo = self._wait_for("ready")[1]
            self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                            name=f"edgeinfer-runner-{self.pid}")
            self._reader.start()
            if tokenizer is None:
                tokenizer = _RemoteTokenizer(self)
            self.tokenizer = tokenizer
            layout = None
            if self.info.vision:
                gf, pcfg = read_mmproj(mmproj)
                gf.close()
                layout = Layout(tokenizer, pcfg)
            self.prompts = Prompter(
                tokenizer, chat_format(md, self.info.cfg.arch), layout=layout,
                encode_image=(lambda im: self.call("encode_image", im)) if layout else None,
                no_images=self.info.vision_note)
        except BaseException:
            self._kill()
            raise
        return self

    # -- start-up ----------------------------------------------------------------------------
    @staticmethod
    def read_vocabulary(path: str):
        """Our tokenizer and the metadata, read while the engine process loads; None for a
        vocabulary only llama.cpp reads (its tokenizer is then asked over the pipe)."""
        gf = read_gguf(path)
        try:
            md = {k: v for k, v in gf.metadata.items()
                  if k.startswith(("tokenizer.", "general."))}
        finally:
            gf.close()
        try:
            tokenizer = Tokenizer.from_gguf(md)
        except Exception:       # noqa: BLE001 - the engine process reads it then
            return None, md
        return tokenizer, md

    def _wait_for(self, kind: str) -> tuple:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            while not self._conn.poll(0.2):
                if not self.process.is_alive():
                    raise LoadFailed(f"the engine process exited while loading "
                                     f"({_exit_text(self.process.exitcode)})")
                if time.monotonic() > deadline:
                    raise LoadFailed("the engine process did not finish loading in time")
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5)
                raise LoadFailed(f"the engine process exited while loading "
                                 f"({_exit_text(self.process.exitcode)})") from None
            if msg[0] != "progress":
                break
            if self._progress is not None:
                self._progress(Progress(msg[1], msg[2], msg[3]))
        if msg[0] == "failed":
            self.process.join(10)
            _, kind, text = msg
            if kind == "MemoryError":
                raise MemoryError(text)
            raise LoadFailed(text)
        if msg[0] != kind:
            raise LoadFailed(f"the engine process sent {msg[0]!r} where {kind!r} was due")
        return msg

    # -- what the server reads -------------------------------------------------------------
    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    @property
    def cfg(self):
        return self.info.cfg

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_embed_tokens(self) -> int:
        return self.info.max_embed_tokens

    @property
    def pooling(self) -> str | None:
        return self.info.pooling

    def snapshot(self) -> dict[str, float]:
        return self._snapshot

    def stats(self) -> dict[str, float]:
        return self._snapshot

    def vision_stats(self) -> dict | None:
        """The projector's counters as of the engine's last step."""
        return self._snapshot.get("vision") if self.info.vision else None

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink, choice: int = 0,
               constraint=None, follows: int | None = None, prompt_logprobs: int | None = None,
               score_only: bool = False, prediction: list[int] | None = None,
               images: list | None = None) -> int:
        """Engine.submit's contract; the checks run here, the request runs there."""
        images = tuple(images or ())
        params, _, _ = check_request(self.info, prompt_ids, params, images, prompt_logprobs,
                                     score_only, prediction)
        spec = None
        if constraint is not None:
            spec = constraint.spec
            if spec is None:
                raise RequestError("this constraint cannot cross to the engine process")
        rid = self._register(sink)
        self._send(("add", rid, list(prompt_ids), params, choice, spec, follows,
                    prompt_logprobs, bool(score_only), list(prediction) if prediction else None,
                    images), rid)
        return rid

    def submit_embed(self, prompt_ids: list[int], sink, pooling: str | None = None) -> int:
        check_embed(self.info, prompt_ids)
        rid = self._register(sink)
        self._send(("embed", rid, list(prompt_ids), pooling or self.info.pooling), rid)
        return rid

    def abort(self, request_id: int) -> None:
        with self._lock:
            known = self._sinks.get(request_id) is not None
        if known:
            self._send(("abort", request_id))

    def call(self, name: str, *args) -> Any:
        """A request-reply to the engine process (image encoding, llama.cpp's tokenizer)."""
        if self.dead:
            raise RunnerDied(self.dead)
        cid = next(self._ids)
        slot = [threading.Event(), False, None]
        with self._lock:
            self._calls[cid] = slot
        self._send(("call", cid, name, args))
        slot[0].wait()
        if not slot[1]:
            kind, text = slot[2]
            if kind == "RunnerDied":
                raise RunnerDied(text)
            if kind in ("VisionError", "RequestError", "ValueError"):
                raise RequestError(text)
            raise RuntimeError(text)
        return slot[2]

    def _register(self, sink) -> int:
        if self.dead:
            raise RunnerDied(self.dead)
        rid = next(self._ids)
        with self._lock:
            self._sinks[rid] = sink
        return rid

    def _send(self, msg: tuple, rid: int | None = None) -> None:
        try:
            with self._lock:
                self._conn.send(msg)
        except (OSError, EOFError, BrokenPipeError, ValueError):
            if rid is not None:
                with self._lock:
                    self._sinks.pop(rid, None)
            raise RunnerDied(self.dead or "the model's engine process is gone") from None

    # -- events ------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        conn = self._conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                _, rid, d = msg
                with self._lock:
                    sink = self._sinks.get(rid)
                    if d["finished"]:
                        self._sinks.pop(rid, None)
                if sink is not None:
                    try:
                        sink(RequestOutput(**d))
                    except Exception:
                        log.exception("request sink failed")
            elif kind == "snap":
                self._snapshot = msg[1]
            elif kind == "reply":
                _, cid, ok, value = msg
                with self._lock:
                    slot = self._calls.pop(cid, None)
                if slot is not None:
                    slot[1], slot[2] = ok, value
                    slot[0].set()
            elif kind == "closed":
                break
        self._gone()

    def _gone(self) -> None:
        """The pipe closed: a close we asked for, or the process died. Every open request
        ends with an error event, every pending call raises."""
        self.process.join(2 if self._closing else 5)
        code = self.process.exitcode
        if self._closing:
            why = "the model was unloaded"
        else:
            why = (f"the model's engine process (pid {self.pid}) died "
                   f"({_exit_text(code)}); the next request loads the model again")
            log.error("%s", why)
        self.dead = why
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for rid, sink in sinks.items():
            try:
                sink(RequestOutput(rid, finished=True, finish_reason="error", error=why,
                                   finish_time=time.monotonic()))
            except Exception:
                log.exception("request sink failed")
        for slot in calls.values():
            slot[1], slot[2] = False, ("RunnerDied", why)
            slot[0].set()
        if not self._closing and self.on_death is not None:
            self.on_death(self)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """End the engine process (its open requests end with "abort" there) and wait."""
        self._closing = True
        if self.process.is_alive():
            try:
                with self._lock:
                    self._conn.send(("close",))
            except (OSError, EOFError, BrokenPipeError, ValueError):
                pass
            self.process.join(timeout)
        self._kill()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)

    shutdown = close

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        try:
            self._conn.close()
        except OSError:
            pass


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
