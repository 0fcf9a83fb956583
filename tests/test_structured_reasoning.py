"""Reasoning split through a real daemon: a synthetic qwen3 model (random weights) whose chat
template thinks Qwen3-style. A grammar forces what it writes, so the test knows the output:
`<think>...</think>` must land in `reasoning_content` (OpenAI) / `thinking` (Ollama) and
never in the content."""
from __future__ import annotations

import ollama
import openai
import pytest

import synth
from daemon_fixture import start_daemon

pytest.importorskip("llguidance")

MODEL = "thinker:latest"
# Qwen3's thinking switch, reduced: enable_thinking=false pre-fills an empty think block
TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "<think>\n\n</think>\n\n{%- endif -%}{%- endif -%}")
FORCED = 'root ::= "<think>" "I should add 2 and 2." "</think>" "\\n\\nIt is 4."'
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("thinker")
    path = d / "thinker.gguf"
    synth.write_model(path, "qwen3", chat_template=TEMPLATE)
    from edgeinfer.store.model_store import Store
    home = d / "home"
    Store(home).register_file(path, MODEL)
    dm = start_daemon(home)
    try:
        yield dm
    finally:
        dm.stop()


@pytest.fixture(scope="module")
def oa(daemon):
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def test_reasoning_content_is_split_out(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                   extra_body={"grammar": FORCED})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert m.content == "It is 4."
    assert m.model_extra["reasoning_content"] == "I should add 2 and 2."


def test_streamed_reasoning_deltas(oa):
    reasoning, content = "", ""
    for ev in oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200,
                                         temperature=0, stream=True,
                                         extra_body={"grammar": FORCED}):
        for ch in ev.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == "I should add 2 and 2."
    assert content == "It is 4."


def test_ollama_think(daemon):
    ol = ollama.Client(host=daemon.url, timeout=300)
    on = ol.chat(model=MODEL, messages=ASK, think=True, options={"num_predict": 3})
    off = ol.chat(model=MODEL, messages=ASK, think=False, options={"num_predict": 3})
    # think=false renders the template's empty think block into the prompt
    assert off.prompt_eval_count > on.prompt_eval_count
    assert "thinking" in ol.show(MODEL).capabilities

