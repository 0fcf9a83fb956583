"""Request metrics, the Prometheus text for /metrics, and the JSON snapshot that
/api/stats/stream sends (its shape is documented in docs/api.md; the TUI reads it).

Everything here is touched from the event loop only (sinks hand events over to the loop
first), so plain counters suffice. Engine figures come from `engine.snapshot()`: a flat dict
of numbers the engine thread publishes after each step (replaced, never changed), so reading
it never touches the scheduler's live structures.
"""
from __future__ import annotations

import bisect
import collections
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import psutil

from edgeinfer import __version__

from .model_manager import LoadedModel, ModelManager

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        sep = "," if labels else ""
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def iso(ts: float) -> str | None:
    if ts == float("inf"):
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class Metrics:
    def __init__(self) -> None:
        self.started = time.time()
        self.requests: collections.Counter = collections.Counter()   # (route, status) -> n
        self.prompt_tokens: collections.Counter = collections.Counter()  # model -> n
        self.gen_tokens: collections.Counter = collections.Counter()
        self.cached_tokens: collections.Counter = collections.Counter()
        self.ttft: dict[str, Histogram] = {}
        self.tpot: dict[str, Histogram] = {}
        self.finish: collections.Counter = collections.Counter()   # (model, reason) -> n
        self._recent: collections.deque = collections.deque()      # (monotonic, tokens)
        self._proc = psutil.Process(os.getpid())

    # ----- recording ---------------------------------------------------------------------
    def on_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def on_tokens(self, n: int) -> None:
        if n:
            self._recent.append((time.monotonic(), n))

    def on_finish(self, model: str, reason: str, prompt: int, output: int, cached: int,
                  arrival: float, first: float | None, end: float | None) -> None:
        self.prompt_tokens[model] += prompt
        self.gen_tokens[model] += output
        self.cached_tokens[model] += cached
        self.finish[(model, reason)] += 1
        if first is not None:
            self.ttft.setdefault(model, Histogram(TTFT_BUCKETS)).observe(first - arrival)
            if end is not None and output > 1:
                self.tpot.setdefault(model, Histogram(TPOT_BUCKETS)).observe(
                    (end - first) / (output - 1))

    def on_abort(self, model: str) -> None:
        self.finish[(model, "abort")] += 1

    def tokens_per_second(self, window: float = 1.0) -> float:
        cutoff = time.monotonic() - window
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / window

    # ----- /metrics ----------------------------------------------------------------------
    def prometheus(self, manager: ModelManager) -> str:
        L: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} {kind}")

        head("edgeinfer_requests_total", "counter", "HTTP requests by route and status code")
        for (route, status), n in sorted(self.requests.items()):
            L.append(f'edgeinfer_requests_total{{route="{_esc(route)}",code="{status}"}} {n}')
        head("edgeinfer_request_finish_total", "counter", "Finished sequences by reason")
        for (m, reason), n in sorted(self.finish.items()):
            L.append(f'edgeinfer_request_finish_total{{model="{_esc(m)}",reason="{reason}"}} {n}')
        for name, ctr, help_ in (
                ("edgeinfer_prompt_tokens_total", self.prompt_tokens, "Prompt tokens (tokens in)"),
                ("edgeinfer_generation_tokens_total", self.gen_tokens, "Generated tokens (out)"),
                ("edgeinfer_prompt_cached_tokens_total", self.cached_tokens,
                 "Prompt tokens served from the prefix cache")):
            head(name, "counter", help_)
            for m, n in sorted(ctr.items()):
                L.append(f'{name}{{model="{_esc(m)}"}} {n}')
        for name, hists, help_ in (
                ("edgeinfer_time_to_first_token_seconds", self.ttft, "Time to first token"),
                ("edgeinfer_time_per_output_token_seconds", self.tpot,
                 "Time per output token after the first")):
            head(name, "histogram", help_)
            for m, h in sorted(hists.items()):
                L.extend(h.lines(name, f'model="{_esc(m)}"'))

        gauges = [
            ("edgeinfer_running_sequences", "running", "Sequences in the running batch"),
            ("edgeinfer_queue_depth", "waiting", "Sequences waiting for admission"),
            ("edgeinfer_kv_blocks_used", "kv_blocks_used", "KV cache blocks referenced"),
            ("edgeinfer_kv_blocks_total", "kv_blocks_total", "KV cache blocks in the pool"),
            ("edgeinfer_kv_blocks_cached", "kv_blocks_cached",
             "Unreferenced KV blocks kept for prefix reuse"),
            ("edgeinfer_prefix_cache_hit_rate", "prefix_hit_rate",
             "Share of prompt tokens found in the prefix cache"),
        ]
        snaps = [(lm, _engine_stats(lm)) for lm in manager.models.values()]
        for name, key, help_ in gauges:
            head(name, "gauge", help_)
            for lm, st in snaps:
                L.append(f'{name}{{model="{_esc(lm.name)}",backend="{lm.backend}"}} '
                         f'{float(st.get(key, 0)):g}')
        vision = [(lm, vs) for lm, _ in snaps if (vs := lm.engine.vision_stats()) is not None]
        for name, key, help_ in (
                ("edgeinfer_images_encoded_total", "images_encoded",
                 "Images run through the vision encoder"),
                ("edgeinfer_image_cache_hits_total", "image_cache_hits",
                 "Images whose encoder output was cached"),
                ("edgeinfer_image_encode_seconds_total", "encode_seconds",
                 "Time spent encoding images")):
            head(name, "counter", help_)
            for lm, vs in vision:
                L.append(f'{name}{{model="{_esc(lm.name)}",backend="{lm.backend}"}} '
                         f'{float(vs[key]):g}')
        head("edgeinfer_model_memory_bytes", "gauge", "Weights plus KV pool of each loaded model")
        for lm, _ in snaps:
            L.append(f'edgeinfer_model_memory_bytes{{model="{_esc(lm.name)}",'
                     f'backend="{lm.backend}"}} {lm.size}')
        head("edgeinfer_models_loaded", "gauge", "Loaded models")
        L.append(f"edgeinfer_models_loaded {len(snaps)}")
        head("edgeinfer_tokens_per_second", "gauge", "Generated tokens per second, last second")
        L.append(f"edgeinfer_tokens_per_second {self.tokens_per_second():g}")
        head("edgeinfer_process_resident_memory_bytes", "gauge", "Daemon RSS")
        L.append(f"edgeinfer_process_resident_memory_bytes {self._proc.memory_info().rss}")
        return "\n".join(L) + "\n"

    # ----- /api/stats ----------------------------------------------------------------------
    def snapshot(self, manager: ModelManager) -> dict:
        vm = psutil.virtual_memory()
        models = []
        snaps = [(lm, _engine_stats(lm)) for lm in manager.models.values()]
        for lm, st in snaps:
            total = int(st.get("kv_blocks_total", 0))
            used = int(st.get("kv_blocks_used", 0))
            models.append({
                "name": lm.name, "backend": lm.backend, "device": lm.device,
                "weights_format": lm.weights_format, "digest": lm.digest,
                "size_bytes": lm.size, "weights_bytes": lm.weights_bytes,
                "kv_bytes": lm.kv_bytes, "context_length": lm.engine.max_model_len,
                "loaded_at": iso(lm.loaded_at), "expires_at": iso(lm.expires_at),
                "expires_in_s": None if lm.expires_at == float("inf")
                else max(0.0, round(lm.expires_at - time.time(), 1)),
                "active_requests": lm.active,
                "engine_pid": lm.engine.pid,     # its own process unless EDGEINFER_ENGINE_PROCESS=0
                "running": int(st.get("running", 0)), "waiting": int(st.get("waiting", 0)),
                "kv_blocks_used": used, "kv_blocks_total": total,
                "kv_blocks_cached": int(st.get("kv_blocks_cached", 0)),
                "kv_used_fraction": round(used / total, 4) if total else 0.0,
                "prefix_hit_rate": float(st.get("prefix_hit_rate", 0.0)),
                "prefix_cached_tokens": int(st.get("prefix_cached_tokens", 0)),
                "preemptions": int(st.get("preemptions", 0)),
                "steps": int(st.get("steps", 0)),
                "tokens_generated": int(st.get("tokens_generated", 0)),
                **({"vision": vs} if (vs := lm.engine.vision_stats()) is not None else {}),
            })
        return {
            "time": time.time(),
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 1),
            "tokens_per_s": self.tokens_per_second(),
            "requests_active": sum(m["active_requests"] for m in models),
            "queue_depth": sum(m["waiting"] for m in models),
            "running": sum(m["running"] for m in models),
            "totals": {
                "requests": sum(self.requests.values()),
                "prompt_tokens": sum(self.prompt_tokens.values()),
                "generation_tokens": sum(self.gen_tokens.values()),
            },
            "process": {"pid": os.getpid(), "rss_bytes": self._proc.memory_info().rss,
                        # the warm engine process for the next load (EDGEINFER_SPARE_RUNNER)
                        "spare_engine": _spare(manager)},
            "system": {"memory_total_bytes": vm.total, "memory_available_bytes": vm.available,
                       "memory_used_bytes": vm.total - vm.available,
                       "memory_used_percent": vm.percent},
            "gpu": _gpu(),
            "compute": _compute(manager, [st for _, st in snaps]),
            "models": models,
            # loads in progress: "compiling kernels (k/n)", then "loading weights"
            "loading": [{"name": st.name, "backend": st.backend, **st.to_dict()}
                        for st in list(getattr(manager, "loading", {}).values())],
        }


def _gpu() -> dict | None:
    """CUDA memory when a torch backend has brought torch in; never imports it ourselves."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        free, total = torch.cuda.mem_get_info()
        return {"memory_used_bytes": total - free, "memory_total_bytes": total}
    except Exception:
        return None


def _compute(manager: ModelManager, snaps: list[dict]) -> dict:
    """The CPU budget: threads the free cores allow, and how many engines step right now.
    In process, one governor serves every engine; with engine processes each has its own
    (it counts the others as busy cores) and reports it in its snapshot."""
    g = manager.governor
    if not manager.config.engine_process:
        return {"cpu_threads": int(g.threads), "engines_stepping": int(g.active_threads()),
                "other_programs_cores": round(float(g.others), 2)}
    mine = [s for s in snaps if "cpu_threads" in s]
    return {"cpu_threads": max([int(s["cpu_threads"]) for s in mine], default=int(g.threads)),
            "engines_stepping": sum(int(s["engine_stepping"]) for s in mine),
            "other_programs_cores": min([float(s["other_programs_cores"]) for s in mine],
                                        default=round(float(g.others), 2))}


def _spare(manager: ModelManager) -> dict | None:
    pid = manager.spares.pid()
    if pid is None:
        return None
    try:
        return {"pid": pid, "rss_bytes": psutil.Process(pid).memory_info().rss,
                "warming": manager.spares.hint()}
    except psutil.Error:        # it ended (taken by a load) since
        return None


def _engine_stats(lm: LoadedModel) -> dict:
    return lm.engine.snapshot()     # published by the engine thread: safe to read from here
