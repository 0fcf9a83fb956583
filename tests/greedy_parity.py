"""Greedy text of our engine against llama.cpp's, token by token, up to llama.cpp's own ties."""
from __future__ import annotations

import numpy as np

from edgeinfer.engine.core import greedy

# llama.cpp disagrees with itself (batched vs token-by-token evaluation of the bundled model)
# by up to ~1.5 logits: a top-2 margin inside this band is a tie that rounding decides.
NOISE_FLOOR = 1.5


def assert_greedy_matches(engine, llm, prompt: str, steps: int) -> None:
    """Greedy continuations equal llama.cpp's token for token (an end of text counts as a
    token) up to the first place where llama.cpp's own top-1/top-2 margin is a tie (under
    NOISE_FLOOR); there, and only there, ours may differ, and then our token must be one of
    llama.cpp's tied candidates (its logit within NOISE_FLOOR of llama.cpp's best). Where the
    first 12 steps have no such tie they must match outright. `llm` keeps logits_all and is
    closed here."""
    e = engine
    ids = e.encode_raw(prompt)
    assert ids == llm.tokenize(prompt.encode(), add_bos=True)
    out = e.generate(ids, greedy(steps))
    END = -1                                # stands for any end-of-text token
    ours = list(out.token_ids) + ([END] if out.finish_reason == "stop" else [])
    ref, margins, rows = [], [], []
    llm.eval(ids)
    for _ in range(steps):
        row = np.array(llm.scores[llm.n_tokens - 1])
        second, first = np.argsort(row)[-2:]
        margins.append(row[first] - row[second])
        rows.append(row)
        t = int(first)
        if t in e.tokenizer.eot_ids:
            ref.append(END)
            break
        ref.append(t)
        llm.eval([t])
    llm.close()
    n = 0
    while n < min(len(ref), len(ours)) and ref[n] == ours[n]:
        n += 1
    show = (prompt, n, e.tokenizer.decode(out.token_ids), e.tokenizer.decode(
        [t for t in ref if t != END]))
    if all(m >= NOISE_FLOOR for m in margins[:12]):
        assert n >= min(12, len(ref)), show
    if n < min(len(ref), len(ours)):
        assert margins[n] < NOISE_FLOOR, (*show, margins[n])
        row = rows[n]
        mine = max(row[list(e.tokenizer.eot_ids)]) if ours[n] == END else row[ours[n]]
        assert mine > row.max() - NOISE_FLOOR, (*show, ours[n], row.max() - mine)


SYNTH_PROMPT = " the a of and in the is to"


def assert_file_greedy_matches(path, steps: int = 32, prompt: str = SYNTH_PROMPT) -> None:
    """assert_greedy_matches for a model file (the synthetic architectures' parity files):
    our engine and libllama each load it with a 512-token context."""
    import llama_cpp

    from edgeinfer.engine.core import Engine, EngineConfig
    engine = Engine(str(path), EngineConfig(max_model_len=512))
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2,
                              verbose=False)
        assert_greedy_matches(engine, llm, prompt, steps)
    finally:
        engine.close()
