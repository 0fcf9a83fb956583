"""Load a runner for a model file: resolve the backend name, then build the runner."""
from __future__ import annotations

from edgeinfer.runners.base import Runner


def load_runner(path: str, backend: str = "cpu", kv_budget_bytes: int = 1 << 30,
                block_size: int = 16, min_kv_tokens: int = 0, max_running_seqs: int = 16,
                max_tokens_per_step: int = 512, batch_invariant: bool = False,
                governor=None, n_threads: int | None = None, repack: bool | None = None,
                torch_dtype: str | None = None, kv_cache_type: str | None = None,
                torch_graphs: bool = True, repack_cache: str | None = None,
                repack_cache_bytes: int = 0) -> Runner:
    """A native ModelRunner (cpu, torch:*) or the llama.cpp runner. `backend` may be "auto"
    (resolved here from the file's architecture, edgeinfer.runners.choice.resolve_for_file);
    the governor is the process's CPU thread budget, shared by every loaded model."""
    from edgeinfer.runners.choice import resolve_for_file
    backend = resolve_for_file(path, backend)
    if backend == "llamacpp":
        from edgeinfer.runners.llamacpp.runner import LlamaCppRunner
        return LlamaCppRunner.load(path, kv_budget_bytes, block_size, min_kv_tokens,
                                   max_running_seqs=max_running_seqs,
                                   max_tokens_per_step=max_tokens_per_step,
                                   n_threads=n_threads, governor=governor,
                                   kv_cache_type=kv_cache_type)
    from edgeinfer.runners.native import ModelRunner
    return ModelRunner.load(path, backend, kv_budget_bytes=kv_budget_bytes,
                            block_size=block_size, min_kv_tokens=min_kv_tokens,
                            batch_invariant=batch_invariant, governor=governor,
                            repack=repack, torch_dtype=torch_dtype, torch_graphs=torch_graphs,
                            kv_cache_type=kv_cache_type, max_running_seqs=max_running_seqs,
                            max_tokens_per_step=max_tokens_per_step, threads=n_threads,
                            repack_cache=repack_cache, repack_cache_bytes=repack_cache_bytes)
