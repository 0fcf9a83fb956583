"""The llama.cpp backend driven by our engine: greedy text equals llama-cpp-python's own
completion, concurrent sequences do not disturb each other, and prefixes are reused both by
our prefix cache and on the llama.cpp side (seq_cp from a finished sequence's cells)."""
from __future__ import annotations

import os

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from edgeinfer.runners.llamacpp.runner import LlamaCppRunner  # noqa: E402
from edgeinfer.engine.core import Engine, EngineConfig, greedy  # noqa: E402
from edgeinfer.runners.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.runners.base import NewRequest, ScheduledSpan, StepPlan  # noqa: E402

os.environ.setdefault("EDGEINFER_THREADS", "2")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]
LONG = ("In the beginning of the twentieth century, physicists discovered that light behaves "
        "both as a wave and as a particle, which led to")


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    events: dict[int, list[int]] = {}
    ids = [engine.submit(p, greedy(max_tokens),
                         lambda o: events.setdefault(o.request_id, []).extend(o.token_ids))
           for p in prompts]
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    return [events.get(r, []) for r in ids]


@pytest.fixture(scope="module")
def engine(gemma3_path):
    e = Engine(str(gemma3_path), EngineConfig(backend="llamacpp", kv_budget_bytes=64 << 20,
                                              max_running_seqs=4))
    yield e
    e.runner.close()


@pytest.fixture(scope="module")
def reference(gemma3_path):
    # our context lets llama.cpp choose flash attention (on, on the CPU); results depend on it
    llm = llama_cpp.Llama(model_path=str(gemma3_path), n_ctx=512, n_threads=2, verbose=False,
                          flash_attn=True)
    cache: dict[str, str] = {}

    def complete(prompt: str, n: int = 32) -> str:
        if (prompt, n) not in cache:
            llm.reset()
            cache[prompt, n] = llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]
        return cache[prompt, n]
    yield complete
    llm.close()


def test_runner_interface(engine):
    r = engine.runner
    assert isinstance(r, LlamaCppRunner)
    assert r.cfg.arch == "gemma3" and r.cfg.vocab_size == 262144
    assert r.kv_plan.capacity_tokens <= r.ctx.n_ctx


# one prompt in the default run, the others under -m slow (~20 s each here)
@pytest.mark.parametrize("text", PROMPTS[:1] + [pytest.param(p, marks=pytest.mark.slow)
                                                 for p in PROMPTS[1:]])
def test_greedy_equals_llama_cpp_completion(engine, reference, text):
    out = engine.generate(engine.encode_raw(text), greedy(32))
    assert out.text == reference(text)


@pytest.mark.slow      # 17 s; the daemons' [llamacpp] tests run concurrent requests too
def test_concurrent_sequences(engine, reference):
    a, b = (engine.encode_raw(t) for t in PROMPTS[:2])
    together = run_requests(engine, [a, b], 32)
    tok = engine.tokenizer
    assert tok.decode(together[0]) == reference(PROMPTS[0])
    assert tok.decode(together[1]) == reference(PROMPTS[1])


def test_prefix_reuse_same_prompt(engine, reference):
    ids = engine.encode_raw(LONG)
    assert len(ids) > 16   # at least one full block to share
    first = engine.generate(ids, greedy(16))
    before = engine.runner.tokens_decoded
    second = engine.generate(ids, greedy(16))
    assert second.num_cached_tokens > 0
    assert second.token_ids == first.token_ids
    assert second.text == reference(LONG, 16)
    # llama.cpp recomputed only the last prompt token, then 15 decode steps
    assert engine.runner.tokens_decoded - before == 1 + 15


@pytest.mark.slow      # 9 s; the same prompt's reuse stays in the default run
def test_prefix_reuse_shared_head_new_tail(engine, reference):
    """A prompt sharing its head with a finished one: llama.cpp copies those cells."""
    engine.generate(engine.encode_raw(LONG), greedy(4))
    text = LONG + " the development of quantum mechanics. Its founders"
    ids = engine.encode_raw(text)
    head = len(engine.encode_raw(LONG))
    before = engine.runner.tokens_decoded
    out = engine.generate(ids, greedy(16))
    assert engine.runner.tokens_decoded - before <= len(ids) - head + 1 + 15
    assert out.text == reference(text, 16)


def test_recompute_from_start_matches(gemma3_path):
    """A sequence resent from position 0 (preemption by recompute) gives the same logits."""
    r = LlamaCppRunner(str(gemma3_path), kv_budget_bytes=8 << 20, max_running_seqs=2, n_threads=2)
    ids = (2, 818, 5279, 529, 7001, 563)
    new = NewRequest(1, ids, SamplingParams(temperature=0.0))
    first = r.execute(StepPlan((ScheduledSpan(1, 0, ids, (), True),), (new,)))
    t1 = first.tokens[1][0]
    step, _ = r.forward([ScheduledSpan(1, 6, (t1,), (), True)])
    again, reused = r.forward([ScheduledSpan(1, 0, ids + (t1,), (), True)])  # resent from 0
    assert reused == {1: 6}        # the slot held the first six: only the last is recomputed
    assert np.abs(again - step).max() < 1e-2 * np.abs(step).max()
    assert again.argmax() == step.argmax()
    r.close()


def test_non_native_architecture_through_auto(tmp_path):
    """An architecture our models do not cover (baichuan: llama-shaped tensors, a name we do
    not run) loads with backend="auto" on llama.cpp and matches llama.cpp's own completion."""
    from synth import write_model
    path = str(write_model(tmp_path / "baichuan.gguf", "baichuan"))
    e = Engine(path, EngineConfig(backend="auto", kv_budget_bytes=4 << 20, max_running_seqs=2))
    assert isinstance(e.runner, LlamaCppRunner) and e.cfg.arch == "baichuan"
    prompt = "the a of"
    out = e.generate(e.encode_raw(prompt), greedy(12, ignore_eos=True))
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False, flash_attn=True)
    ref = []   # token ids: random weights emit byte tokens whose text is not valid UTF-8
    eos = llm.token_eos()
    for t in llm.generate(llm.tokenize(prompt.encode()), temp=0.0):
        if t == eos:   # llama.cpp stops here; we were told to ignore EOS
            break
        ref.append(t)
        if len(ref) == 12:
            break
    llm.close()
    e.runner.close()
    assert ref and out.token_ids[:len(ref)] == ref


def test_llama_tokenizer_fallback_agrees(engine):
    """The fallback used for vocabularies our tokenizer cannot read agrees with ours here."""
    from edgeinfer.runners.llamacpp.tokenizer import LlamaTokenizer
    ours = engine.tokenizer
    theirs = LlamaTokenizer(engine.runner.ctx, engine.runner.gf.metadata)
    text = "Hello world! Ünïcödé and <start_of_turn>user\n  spaces"
    for special in (False, True):
        ids = ours.encode(text, add_special=True, parse_special=special)
        assert theirs.encode(text, add_special=True, parse_special=special) == ids
    assert theirs.decode(ids) == ours.decode(ids)
    assert theirs.bos_id == ours.bos_id and theirs.eot_ids == ours.eot_ids


def test_llamacpp_takes_its_threads_from_the_process_governor(gemma3_path):
    """One CPU budget per process: the llama.cpp runner asks the shared governor before each
    step, as the native CPU backend does, instead of fixing its count at load."""
    from edgeinfer.backends.threads import ThreadGovernor
    gov = ThreadGovernor(fixed=1)
    e = Engine(str(gemma3_path), EngineConfig(backend="llamacpp", kv_budget_bytes=8 << 20,
                                              max_model_len=256, governor=gov))
    try:
        assert e.runner.ctx.n_threads != 1 or os.cpu_count() == 1
        out = e.generate(e.encode_raw("The sky is"), greedy(4))
        assert out.num_output_tokens == 4
        assert e.runner.ctx.n_threads == 1
    finally:
        e.close()
