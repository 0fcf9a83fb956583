"""Loaded models: one Engine per (model, backend), loaded on first use, unloaded after its
keep_alive, several at once within a memory budget (least recently used idle model goes
first). A load that would not fit in free memory is refused with the numbers.

All methods run on the event loop; loads and unloads run in worker threads. A model with
requests in flight is never unloaded: its expiry applies once the last request ends.

Unloading is deterministic: the engine is closed (its thread joined, the runner's weights, KV
pool and GGUF mapping released), the manager drops every reference it holds, and the freed
heap is handed back to the OS, so the daemon's RSS returns to what it was before the load.
Every loaded engine shares the manager's one CPU thread governor: two models generating at
once split the cores instead of each taking all of them.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
import weakref
from dataclasses import dataclass, field

import psutil

from edgeinfer.engine import heap
from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.engine.remote import LoadFailed, RemoteEngine
from edgeinfer.engine.spare import SpareRunner
from edgeinfer.engine.warmup import prepare_for_load
from edgeinfer.formats.gguf_file import GGUFError, read_gguf
from edgeinfer.settings import Settings, check_kv_cache_type, parse_duration
from edgeinfer.runners.choice import (BackendChoiceError, check, cpu_only_for_file, device_of,
                                      estimate_memory, native_for_file, require_device, resolve,
                                      with_defaults)
from edgeinfer.store.model_store import ModelNotFound, Store, StoreError

from .errors import APIError, not_found

log = logging.getLogger("edgeinfer.server")

def parse_keep_alive(value: float | int | str | None, default: float) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "0");
    negative keeps the model loaded forever (math.inf here). A 400 for anything else."""
    if value is None or value == "":
        return default
    try:
        return parse_duration(value)
    except ValueError as e:
        raise APIError(400, f"keep_alive {e}" if not isinstance(value, bool) else
                       "keep_alive must be a duration like \"5m\" or a number of seconds",
                       param="keep_alive") from None


@dataclass(frozen=True)
class ServerConfig(Settings):
    """The daemon's settings: the process Settings with the default backend/device pair
    filled and validated (a named cuda/mps device must be present)."""

    @classmethod
    def from_env(cls, env=None, **overrides) -> "ServerConfig":
        """The environment's settings, then `overrides` (command-line flags) on top.
        BackendChoiceError (a ValueError) with one sentence for a bad backend/device pair;
        SettingsError (a ValueError) naming the variable for a bad value."""
        base = Settings.from_env(env)
        env_backend = base.backend if base.backend_set else None
        backend, device = with_defaults(env_backend, base.device, "cpu", None)
        backend, device = with_defaults(overrides.pop("backend", None),
                                        overrides.pop("device", None), backend, device)
        check(backend, device)
        if device in ("cuda", "mps"):
            require_device(device)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Settings)}
        fields.update(backend=backend, device=device)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def budget(self) -> int:
        return self.memory_budget_bytes or int(psutil.virtual_memory().total * 0.75)


@dataclass
class LoadedModel:
    name: str                       # full name, e.g. gemma3:270m
    backend: str
    engine: Engine | RemoteEngine
    digest: str | None
    weights_bytes: int
    kv_bytes: int
    loaded_at: float                # wall clock
    load_duration: float            # seconds
    keep_alive: float
    active: int = 0                 # requests in flight (choices count separately)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float = float("inf")  # wall clock; inf while busy or kept forever
    kv_cache_type: str = "f16"      # the KV pool's element type (f16, q8_0; f32)
    kv_bytes_per_token: int = 0     # what one token of context takes in that pool
    kv_window: int = 0              # sliding-window layers kept apart: they hold this many

    @property
    def size(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def device(self) -> str:
        return device_of(self.backend)

    @property
    def weights_format(self) -> str:
        """How the runner holds the weights: gguf (quantized), gguf (llama.cpp), or torch's
        dtype (float32, bfloat16, float16)."""
        return self.engine.info.weights_format

    def refresh_expiry(self) -> None:
        self.last_used = time.monotonic()
        self.expires_at = float("inf") if self.active else time.time() + self.keep_alive


def _arch_of(path) -> str | None:
    """general.architecture from the file, for manifests written without it."""
    try:
        f = read_gguf(str(path))
    except (GGUFError, OSError):
        return None          # the load reports the broken file
    try:
        arch = f.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None
    finally:
        f.close()


def close_engine(engine: Engine | RemoteEngine) -> None:
    """Stop the engine (its thread, or its process) and release its runner: weights, KV
    pool, GGUF mapping. Any thread but the engine's own."""
    engine.close()


def release_memory() -> None:
    """Collect what an unloaded engine left (its objects reference each other; its compiled
    grammars go with its tokenizer) and give the freed heap back to the OS. Call once
    nothing references the engine any more."""
    gc.collect()
    heap.trim()




@dataclass
class LoadStatus:
    """A load in progress, as /api/ps, /api/stats and `edgeinfer run` show it: the stage
    ("compiling kernels", "loading weights") and, while kernels compile, steps done of total
    and the step that finished last."""
    name: str
    backend: str
    stage: str = "loading weights"
    done: int = 0
    total: int = 0
    step: str = ""
    started: float = field(default_factory=time.monotonic)

    @property
    def text(self) -> str:
        if self.stage == "compiling kernels":
            return f"compiling kernels ({self.done}/{self.total})"
        return self.stage

    def to_dict(self) -> dict:
        return {"stage": self.stage, "text": self.text, "done": self.done, "total": self.total,
                "step": self.step, "elapsed_s": round(time.monotonic() - self.started, 1)}


def _projector(ref) -> str | None:
    """The store entry's vision projector file, if it has one."""
    return str(ref.projector_path) if ref.projector_path else None


def _load_engine(path: str, ecfg: EngineConfig, mmproj: str | None,
                 remote: RemoteEngine | None, status: LoadStatus) -> Engine | RemoteEngine:
    """The engine for a model file: `remote`'s process, which compiles what kernels the
    model needs first, or one in this process after compiling them here. `status` shows
    the progress ("compiling kernels (k/n)", then "loading weights")."""
    def progress(p) -> None:        # an edgeinfer.engine.warmup.Progress
        status.stage, status.done, status.total, status.step = (
            "compiling kernels", p.done, p.total, p.label)
        if p.done >= p.total:
            status.stage = "loading weights"
    if remote is not None:
        return remote.load(progress)
    prepare_for_load(path, ecfg.backend, ecfg.kv_cache_type, ecfg.repack, progress, status.name)
    status.stage = "loading weights"
    return Engine(path, ecfg, mmproj=mmproj).start()


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class ModelManager:
    def __init__(self, config: ServerConfig, store: Store | None = None,
                 spares: SpareRunner | None = None):
        self.config = config
        self.store = store or Store()
        self.models: dict[tuple[str, str], LoadedModel] = {}
        self.loading: dict[tuple[str, str], LoadStatus] = {}     # loads in progress
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._global = asyncio.Lock()       # serializes budget decisions between loads
        self._reaper: asyncio.Task | None = None
        # One compute budget for the process: every engine's CPU kernels (and the llama.cpp
        # runner's thread count) ask this governor how many threads to use for a step.
        # numba-free: the daemon splits budgets, its engine processes run the kernels
        from edgeinfer.backends.threads import ThreadGovernor
        self.governor = ThreadGovernor(fixed=config.threads)
        heap.pin_mmap_threshold()
        # A warm engine process for the next load (edgeinfer/engine/spare.py), warming the
        # kernels of the last model loaded on the CPU (at first, the bundled default's).
        # `spares`: the daemon's, started before its imports (server/daemon.py early_spare)
        self.spares = spares or SpareRunner(config.engine_process and config.spare_runner,
                                            logging.getLogger("edgeinfer").getEffectiveLevel())
        self._spare_hint: str | None = None
        self._busy_until = 0.0          # monotonic: the last load's end

    # ----- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        if self.spares.enabled:     # the bundled default's kernels, if it is in the store
            from edgeinfer.store.bundled import DEFAULT_MODEL   # lazy: only with spares on
            with contextlib.suppress(StoreError, OSError):
                ref = self.store.get(DEFAULT_MODEL)     # never assembles it from its package
                self._spare_hint = str(ref.path) if ref is not None else None

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for key in list(self.models):
            await self._unload(key)
        await asyncio.to_thread(self.spares.close)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self.reap()
            except Exception:
                log.exception("unloading expired models failed")
            try:
                await self._refill_spare()
            except Exception:
                log.exception("starting a spare engine process failed")

    async def _refill_spare(self) -> None:
        """Start the next spare engine process once nothing has loaded or generated for a
        second: its start-up would take cores from a load or a first request."""
        if not self.spares.wanted() or self.loading:
            return
        if any(m.active for m in self.models.values()):
            return
        last = max([self._busy_until] + [m.last_used for m in self.models.values()])
        if time.monotonic() - last < 1.0:
            return
        await asyncio.to_thread(self.spares.refill, self._spare_hint)

    async def reap(self) -> None:
        now = time.time()
        expired = [k for k, lm in self.models.items() if lm.active == 0 and lm.expires_at <= now]
        for key in expired:         # keys only: a LoadedModel held here would outlive its unload
            log.info("unloading %s (keep_alive expired)", key[0])
            await self._unload(key)

    async def _unload(self, key: tuple[str, str]) -> None:
        lm = self.models.pop(key, None)
        if lm is None:
            return
        name, engine = lm.name, lm.engine
        del lm                  # this frame must not keep the engine alive past close
        await asyncio.to_thread(close_engine, engine)
        alive = weakref.ref(engine)
        del engine
        await asyncio.to_thread(release_memory)
        if alive() is not None:     # a reference we do not know of keeps it: say who holds it
            log.warning("unloaded %s, but its engine is still referenced by: %s", name,
                        ", ".join(sorted({type(r).__name__ for r in gc.get_referrers(alive())})))
        else:
            log.info("unloaded %s", name)

    # ----- lookup ------------------------------------------------------------------------
    def resolve(self, model: str):
        """Store lookup with API errors (404 unknown, 400 malformed)."""
        try:
            return self.store.resolve(model, allow_path=False)
        except ModelNotFound as e:
            raise not_found(model, str(e)) from None
        except StoreError as e:        # InvalidModelName and friends
            raise APIError(400, str(e), param="model", code="invalid_model_name") from None

    def find_loaded(self, model: str) -> list[LoadedModel]:
        try:
            full = self.store.resolve(model, allow_path=False).full_name if ":" not in model else model
        except StoreError:
            full = model
        return [lm for (name, _), lm in self.models.items() if name in (model, full)]

    # ----- acquire / release ---------------------------------------------------------------
    def choose_backend(self, ref, backend: str | None = None, device: str | None = None) -> str:
        """The concrete backend (cpu, llamacpp, torch:DEVICE) a request's `backend`/`device`
        load options mean for this model, the server's defaults filling what they leave out.
        A bad name, or a device this machine lacks, is a 400 naming the field."""
        backend, device = with_defaults(backend, device, self.config.backend, self.config.device)
        arch = (ref.manifest.get("gguf") or {}).get("architecture")
        if not isinstance(arch, str):
            arch = _arch_of(ref.path)
        try:   # auto: a file using a feature the native engine lacks goes to llama.cpp
            auto = backend.partition(":")[0] == "auto"
            native = not auto or native_for_file(ref.path)
            # a llama file with experts runs natively on the CPU only (not torch:cuda)
            return resolve(backend, device, arch, native,
                           cpu_only=auto and cpu_only_for_file(ref.path))
        except BackendChoiceError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_parameter") from None

    def choose_kv_cache_type(self, backend: str, kv_cache_type: str | None,
                             loaded: LoadedModel | None) -> str:
        """The KV cache type a load on `backend` gets: the request's `kv_cache_type` load
        option, else the loaded copy's, else the server's (EDGEINFER_KV_CACHE_TYPE /
        --kv-cache-type). 400 for a bad name or a type the backend does not have."""
        if kv_cache_type is None:
            return loaded.kv_cache_type if loaded is not None else self.config.kv_cache_type
        try:
            check_kv_cache_type(kv_cache_type)
        except ValueError as e:
            raise APIError(400, str(e), param="kv_cache_type", code="invalid_parameter") from None
        if kv_cache_type != "f16" and backend.startswith("torch"):
            raise APIError(400, f"kv_cache_type {kv_cache_type!r} is not available on the "
                           f"{backend} backend (its KV cache is f16): use the cpu or llamacpp "
                           "backend", param="kv_cache_type", code="invalid_parameter")
        return kv_cache_type

    async def acquire(self, model: str, backend: str | None = None, sequences: int = 1,
                      keep_alive: float | None = None, device: str | None = None,
                      kv_cache_type: str | None = None) -> tuple[LoadedModel, float]:
        """The loaded model (loading it if needed) with `sequences` counted in flight.
        Returns it and the seconds spent loading (0 when it was loaded already). The caller
        must call release() exactly once. `backend`/`device` are the request's load options
        (None: the server's defaults); a model is loaded once per concrete backend.
        `kv_cache_type` (f16, q8_0; None: as loaded, else the server's) is one too: a copy
        loaded with another type is reloaded when idle, and a busy one refuses with a 400."""
        ref = await asyncio.to_thread(self.resolve, model)
        backend = await asyncio.to_thread(self.choose_backend, ref, backend, device)
        key = (ref.full_name, backend)
        lock = self._locks.setdefault(key, asyncio.Lock())
        load_time = 0.0
        async with lock:
            lm = self.models.get(key)
            if lm is not None and lm.engine.dead:
                self.models.pop(key, None)      # its death notice cleans up
                lm = None
            kv_type = self.choose_kv_cache_type(backend, kv_cache_type, lm)
            if lm is not None and lm.kv_cache_type != kv_type:
                if lm.active:
                    raise APIError(400, f"{lm.name} is loaded on {backend} with a "
                                   f"{lm.kv_cache_type} KV cache and serves {lm.active} "
                                   f"sequences; kv_cache_type {kv_type!r} needs a reload: "
                                   "retry when they finish, or leave kv_cache_type out",
                                   param="kv_cache_type", code="invalid_parameter")
                log.info("reloading %s with a %s KV cache (was %s)", lm.name, kv_type,
                         lm.kv_cache_type)
                lm = None
                await self._unload(key)
            if lm is None:
                t0 = time.monotonic()
                lm = await self._load(key, ref, kv_type)
                load_time = time.monotonic() - t0
            limit = self.config.max_running_seqs + self.config.max_queue
            if lm.active + sequences > limit:
                raise APIError(429, f"server busy: {lm.name} has {lm.active} sequences in "
                               f"flight, this request adds {sequences}, the limit is {limit}; "
                               "retry later", code="overloaded")
            lm.active += sequences
            if keep_alive is not None:
                lm.keep_alive = keep_alive
            lm.refresh_expiry()
        return lm, load_time

    def release(self, lm: LoadedModel, sequences: int = 1) -> None:
        lm.active = max(0, lm.active - sequences)
        lm.refresh_expiry()
        if lm.active == 0 and lm.keep_alive == 0:
            try:
                asyncio.get_running_loop().create_task(self.reap())
            except RuntimeError:    # called from a finalizer off the loop: the reaper will do
                pass

    async def _load(self, key: tuple[str, str], ref, kv_cache_type: str | None = None) -> LoadedModel:
        cfg = self.config
        kv_cache_type = kv_cache_type or cfg.kv_cache_type
        ecfg = EngineConfig.from_settings(cfg, key[1], governor=self.governor,
                                          kv_cache_type=kv_cache_type)
        # what the backend will really hold: repacked tiles on the CPU, dense tensors in
        # torch's dtype; the KV pool never grows past its budget. An engine process works
        # it out itself (the backend's modules, torch too, never enter the daemon).
        remote: RemoteEngine | None = None
        try:
            if cfg.engine_process:
                remote = await asyncio.to_thread(
                    RemoteEngine, str(ref.path), ecfg, _projector(ref), self._death_notice(key),
                    None, ref.full_name, spare=self.spares.take())
                est = remote.estimate
            else:
                est = await asyncio.to_thread(estimate_memory, key[1], str(ref.path),
                                              kv_cache_type, cfg.repack, cfg.torch_dtype)
        except (APIError, MemoryError):
            raise
        except Exception as e:  # the file broke after it was stored: one sentence, as a load
            raise APIError(500, f"cannot load {ref.full_name}: {e}", code="load_failed") from None
        try:
            lm = await self._load_within_budget(key, ref, kv_cache_type, est, ecfg, remote)
        except BaseException:
            if remote is not None and not hasattr(remote, "info"):
                await asyncio.to_thread(remote.close)      # refused before it loaded
            raise
        finally:
            self._busy_until = time.monotonic()
        if key[1] == "cpu":
            self._spare_hint = str(ref.path)    # the next spare warms this model's kernels
        return lm

    async def _load_within_budget(self, key, ref, kv_cache_type: str, est, ecfg: EngineConfig,
                                  remote: RemoteEngine | None) -> LoadedModel:
        cfg = self.config
        weights = est.weights_bytes
        proj = ref.projector_path
        if proj is not None:        # the vision projector loads with it (its GGUF's size)
            with contextlib.suppress(OSError):
                weights += proj.stat().st_size
        need = weights + cfg.kv_budget_bytes
        async with self._global:
            budget = cfg.budget()
            if need > budget:
                raise APIError(503, f"cannot load {ref.full_name}: it needs {_gib(need)} "
                               f"(weights {_gib(weights)} + KV cache {_gib(cfg.kv_budget_bytes)}) "
                               f"but the memory budget is {_gib(budget)}",
                               code="insufficient_memory")
            # LRU: unload idle models until the new one fits the budget and the count.
            while True:
                used = sum(m.size for m in self.models.values())
                if used + need <= budget and len(self.models) < cfg.max_loaded_models:
                    break
                idle = [k for k, m in self.models.items() if m.active == 0]
                if not idle:
                    raise APIError(503, f"cannot load {ref.full_name} now: it needs {_gib(need)} "
                                   f"and the busy models use {_gib(used)} of the {_gib(budget)} "
                                   f"budget ({len(self.models)} of {cfg.max_loaded_models} "
                                   "models); retry when they finish", code="insufficient_memory")
                victim = min(idle, key=lambda k: self.models[k].last_used)
                log.info("unloading %s to make room for %s", victim[0], ref.full_name)
                await self._unload(victim)
            free = psutil.virtual_memory().available
            if need > free:
                raise APIError(503, f"cannot load {ref.full_name}: it needs {_gib(need)} "
                               f"(weights {_gib(weights)} + KV cache {_gib(cfg.kv_budget_bytes)}) "
                               f"but only {_gib(free)} of memory is free",
                               code="insufficient_memory")
            t0 = time.monotonic()
            failure: BaseException | None = None
            status = self.loading[key] = LoadStatus(ref.full_name, key[1])
            try:
                engine = await asyncio.to_thread(_load_engine, str(ref.path), ecfg,
                                                 _projector(ref), remote, status)
            except (APIError, MemoryError) as e:
                failure = e
            except LoadFailed as e:     # the engine process's own sentence
                failure = APIError(500, f"cannot load {ref.full_name}: {e}", code="load_failed")
            except Exception as e:      # a broken file or unsupported arch: one sentence
                failure = APIError(500, f"cannot load {ref.full_name}: {e}", code="load_failed")
            finally:
                self.loading.pop(key, None)
            if failure is not None:
                # The half-built engine is garbage once no traceback holds its frames: drop
                # them, collect and trim, then report.
                failure.__traceback__ = failure.__context__ = failure.__cause__ = None
                await asyncio.to_thread(release_memory)
                raise failure
            info = engine.info
            lm = LoadedModel(
                name=ref.full_name, backend=key[1], engine=engine, digest=ref.digest,
                weights_bytes=info.weights_bytes, kv_bytes=info.kv_bytes,
                loaded_at=time.time(), load_duration=time.monotonic() - t0,
                keep_alive=cfg.keep_alive, kv_cache_type=kv_cache_type,
                kv_bytes_per_token=info.kv_bytes_per_token, kv_window=info.kv_window)
            del engine
            self.models[key] = lm
            log.info("loaded %s on %s in %.1fs", lm.name, lm.backend, lm.load_duration)
            return lm

    def _death_notice(self, key: tuple[str, str]):
        """What a RemoteEngine calls (on its reader thread) when its process dies: the model
        leaves the loaded set on the event loop, so the next request loads it again."""
        loop = asyncio.get_running_loop()

        def notice(engine) -> None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drop_dead(key, engine)))
        return notice

    async def _drop_dead(self, key: tuple[str, str], engine) -> None:
        lm = self.models.get(key)
        if lm is not None and lm.engine is engine:
            log.warning("%s: its engine process died; it loads again on the next request",
                        lm.name)
            self.models.pop(key, None)
        del lm
        await asyncio.to_thread(close_engine, engine)
        del engine
        await asyncio.to_thread(release_memory)

    async def unload(self, model: str) -> int:
        """Unload now (Ollama's keep_alive 0 / `stop`): idle copies at once, busy ones when
        their last request ends. Returns how many copies were found."""
        found = self.find_loaded(model)
        for lm in found:
            lm.keep_alive = 0
            lm.refresh_expiry()
        count = len(found)
        found = lm = None        # the reaper must hold the only references
        await self.reap()
        return count
