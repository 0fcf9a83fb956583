"""The Runner, Ops and Model protocols are complete: every implementation has every member
its callers use, so callers read them plainly, never probing with getattr/hasattr."""
from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from edgeinfer.backends.base import Ops
from edgeinfer.models.base import Model, ModelBase
from edgeinfer.runners.base import Runner

REPO = Path(__file__).resolve().parent.parent

# getattr(X, ...) / hasattr(X, ...) whose first argument X is a runner, an ops object or a
# model: a bare name or a dotted expression ending in `runner`, `ops` or `model` (runner,
# self.runner, lm.engine.runner, ops, self.ops, model, self.model...). Scanned: every .py
# file under edgeinfer/, backends/ and models/ (the installed package), comments included.
PROBE = re.compile(r"\b(getattr|hasattr)\(\s*(?:[A-Za-z_][A-Za-z0-9_.]*\.)?"
                   r"(runner|ops|model)\s*,")
# Files whose owner is rewriting them and removes their probes there; each entry must still
# have probes (a stale entry fails), so the list only shrinks.
LEFT_TO_THEIR_OWNER: set[str] = set()


def _probes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in ("edgeinfer", "backends", "models"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PROBE.search(line):
                    found.setdefault(rel, []).append(f"{rel}:{n}: {line.strip()}")
    return found


def test_the_pattern_sees_probes():
    for line in ('getattr(self.runner, "pooling", None)', 'hasattr(runner, "image_encoder")',
                 'getattr(ops, "kv_window_group", False)', "getattr( self.model ,'x')",
                 'getattr(getattr(self.runner, "model", None), "f", None)'):
        assert PROBE.search(line), line
    for line in ('getattr(args, "device", None)', 'getattr(self.models, "x")',
                 'getattr(tok, "bos_id", None)', 'self.runner.pooling'):
        assert not PROBE.search(line), line


def test_no_getattr_probes_of_runners_ops_or_models():
    found = _probes()
    left = [hit for rel, hits in found.items() if rel not in LEFT_TO_THEIR_OWNER
            for hit in hits]
    assert not left, "read the protocol member plainly instead:\n" + "\n".join(left)
    stale = LEFT_TO_THEIR_OWNER - set(found)
    assert not stale, f"no probes left in {sorted(stale)}: take them off LEFT_TO_THEIR_OWNER"


def members(protocol: type) -> set[str]:
    """A Protocol's members: its annotated attributes, methods and properties."""
    names = set(vars(protocol).get("__annotations__", {}))
    names |= {n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def test_members_are_what_the_callers_read():
    """The protocols name what the engine and the runner read (a spot check of members
    added when the probes went)."""
    assert {"gf", "pooling", "embedding_only", "supports_images", "weights_format",
            "set_context_length", "image_encoder", "execute", "tokenizer"} <= members(Runner)
    assert {"kv_window_group", "exact_drafts", "rows_exact", "per_row", "put_rows",
            "kv_cache_type", "weights_format"} <= members(Ops)
    assert {"non_causal", "embedding_only", "accepts_embeddings", "has_rank_head",
            "post_pool", "rank_head", "set_context_length", "forward"} <= members(Model)


def _missing(obj, protocol: type) -> list[str]:
    return sorted(n for n in members(protocol) if n not in dir(obj))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from edgeinfer.engine.warmup import write_tiny_model
    return str(write_tiny_model(tmp_path_factory.mktemp("protocols") / "llama.gguf", "llama"))


def test_every_ops_has_every_member():
    from edgeinfer.backends.cpu.ops import CpuOps
    assert _missing(CpuOps(), Ops) == []
    pytest.importorskip("torch")
    from edgeinfer.backends.torch.ops import TorchOps
    assert _missing(TorchOps(device="cpu", check_memory=False), Ops) == []


def test_every_runner_has_every_member(tiny_llama):
    from edgeinfer.runners.native import ModelRunner
    native = ModelRunner.load(tiny_llama, "cpu", kv_budget_bytes=1 << 20)
    try:
        assert _missing(native, Runner) == []
        assert native.image_encoder("unused.gguf") is None     # the native tower's job
    finally:
        native.close()
    pytest.importorskip("llama_cpp")
    from edgeinfer.runners.llamacpp.runner import LlamaCppRunner
    llama = LlamaCppRunner.load(tiny_llama, kv_budget_bytes=1 << 20)
    try:
        assert _missing(llama, Runner) == []
        assert llama.pooling is None and not llama.embedding_only
    finally:
        llama.close()


def _model_classes() -> list[type]:
    import edgeinfer.models as pkg
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"edgeinfer.models.{info.name}")
    out, todo = [], [ModelBase]
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        if c is not ModelBase and "forward" in dir(c):
            out.append(c)
    return out


def test_every_model_class_has_every_member():
    """Every architecture's class (all of ModelBase's subclasses) has every member at class
    level (instances are checked too, on the models built below)."""
    classes = _model_classes()
    assert {c.__name__ for c in classes} >= {
        "LlamaModel", "Qwen2Model", "Gemma3Model", "GemmaEmbeddingModel", "BertModel",
        "VariantModel", "Phi3Model", "Mistral3Model", "SmolLM3Model", "Qwen3MoeModel"}
    for c in classes:
        assert _missing(c, Model) == [], c.__name__


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_built_models_have_every_member(tmp_path, arch):
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.engine.warmup import write_tiny_model
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    from edgeinfer.models import build_model
    gf = read_gguf(str(write_tiny_model(tmp_path / f"{arch}.gguf", arch)))
    try:
        model = build_model(load_model_config(gf), CpuOps(), gf)
        assert _missing(model, Model) == []
        assert model.accepts_embeddings and not model.non_causal and model.post_pool is None
        with pytest.raises(RuntimeError, match="no classification head"):
            model.rank_head(None)
    finally:
        gf.close()


def test_every_model_is_built_as_a_model_base():
    """build_model's architectures all start from ModelBase (so a new one gets the plain
    answers and the class check above sees it)."""
    src = (REPO / "models" / "__init__.py").read_text(encoding="utf-8")
    built = set(re.findall(r"return (\w+)\(cfg, ops, gguf_file\)", src))
    by_name = {c.__name__: c for c in _model_classes()}
    assert built and built <= set(by_name), built - set(by_name)
