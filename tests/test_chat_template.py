"""Chat templates: sandboxed rendering, built-in fallbacks, real templates from llama.cpp's
models/templates/ (fetched by tests/data/fetch_llama_vocab.sh) against hand-checked strings."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeinfer.formats.chat_template import (BUILTIN_NAMES, ChatFormat, ChatTemplateError,
                                     ChatTemplateSecurityError,
                                     builtin_name_for, builtin_template, chat_template_for,
                                     encode_prompt, render_chat, special_token_strings)

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(os.environ.get("EDGEINFER_TEST_DATA", REPO / ".cache" / "llama-vocab")) / "templates"

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def real(name: str) -> str:
    p = TEMPLATES / f"{name}.jinja"
    if not p.exists():
        pytest.skip(f"real chat templates missing in {TEMPLATES}: run tests/data/fetch_llama_vocab.sh")
    return p.read_text("utf-8")


# --- built-in fallbacks ------------------------------------------------------------------------

def test_builtin_gemma_folds_system_into_first_user_turn():
    out = render_chat(builtin_template("gemma"), CONV, bos_token="<bos>")
    assert out == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                   "<start_of_turn>model\nHello!<end_of_turn>\n"
                   "<start_of_turn>user\n2+2?<end_of_turn>\n"
                   "<start_of_turn>model\n")


def test_builtin_gemma_without_system_or_generation_prompt():
    out = render_chat(builtin_template("gemma"), [{"role": "user", "content": "  hi \n"}],
                      add_generation_prompt=False, bos_token="<bos>")
    assert out == "<bos><start_of_turn>user\nhi<end_of_turn>\n"


def test_builtin_gemma_matches_googles_gemma_template_without_system():
    msgs = CONV[1:]
    ours = render_chat(builtin_template("gemma"), msgs, bos_token="<bos>")
    assert ours == render_chat(real("google-gemma-2-2b-it"), msgs, bos_token="<bos>")


def test_builtin_chatml_llama2_llama3():
    assert render_chat(builtin_template("chatml"), CONV) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render_chat(builtin_template("llama2"), CONV, bos_token="<s>", eos_token="</s>") == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]")
    assert render_chat(builtin_template("llama3"), CONV[1:2], bos_token="<|begin_of_text|>") == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chat_template_for_picks_own_then_fallback():
    own = "{{ messages[0]['content'] }}"
    assert chat_template_for({"tokenizer.chat_template": own}, "llama") == own
    assert builtin_name_for({}, "gemma3") == "gemma"
    assert builtin_name_for({}, "qwen2") == "chatml"
    assert builtin_name_for({"tokenizer.ggml.tokens": ["<|start_header_id|>", "<|eot_id|>"]},
                            "llama") == "llama3"
    assert builtin_name_for({"tokenizer.ggml.tokens": ["<s>", "</s>", "<|im_start|>"]},
                            "llama") == "chatml"
    assert builtin_name_for({"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"]}, "llama") == "llama2"
    assert builtin_name_for({"tokenizer.ggml.tokens": ["<|channel|>", "<|message|>"]},
                            "gpt-oss") == "harmony"
    assert set(BUILTIN_NAMES) == {"gemma", "llama2", "llama3", "chatml", "harmony"}


def test_bundled_gemma3_gets_gemma_fallback_and_tokenizes_turns(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    md = read_gguf(gemma3_path).metadata
    assert "tokenizer.chat_template" not in md
    tmpl = chat_template_for(md, md["general.architecture"])
    assert tmpl == builtin_template("gemma")
    specials = special_token_strings(md)
    assert specials == {"bos_token": "<bos>", "eos_token": "<eos>"}
    prompt = render_chat(tmpl, CONV[1:2], **specials)
    tok = Tokenizer.from_gguf(md)
    ids = encode_prompt(tok, prompt)
    sot, eot = tok.token_to_id["<start_of_turn>"], tok.token_to_id["<end_of_turn>"]
    assert ids[:2] == [tok.bos_id, sot]               # one BOS, not two
    assert ids.count(sot) == 2 and ids.count(eot) == 1
    fmt = ChatFormat.from_gguf(md, "gemma3")
    assert fmt.builtin == "gemma" and fmt.render(CONV[1:2]) == prompt
    assert fmt.encode(tok, CONV[1:2]) == ids


def test_chat_format_uses_the_models_own_template_and_checks_it_early():
    md = {"tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}",
          "tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 1}
    fmt = ChatFormat.from_gguf(md, "llama")
    assert fmt.builtin is None and fmt.render(CONV[1:2]) == "<s>Hi"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatFormat.from_gguf({**md, "tokenizer.chat_template": "{% if %}"}, "llama")


# --- real templates (llama.cpp's models/templates) ---------------------------------------------

def test_llama31_real_template():
    out = render_chat(real("meta-llama-Llama-3.1-8B-Instruct"), CONV,
                      bos_token="<|begin_of_text|>", date_string="26 Jul 2024")
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama32_real_template_uses_strftime_now():
    import datetime
    out = render_chat(real("meta-llama-Llama-3.2-3B-Instruct"), CONV[1:2],
                      bos_token="<|begin_of_text|>")
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}\n\n<|eot_id|>" in out
    assert out.endswith("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen25_real_template_default_system_and_tools():
    tmpl = real("Qwen-Qwen2.5-7B-Instruct")
    assert render_chat(tmpl, CONV[1:2]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(tmpl, CONV, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n")
    tool = {"type": "function", "function": {"name": "météo", "description": "a <b> & c",
                                             "parameters": {}}}
    out = render_chat(tmpl, CONV[1:2], tools=[tool])
    # tojson as in transformers: no HTML escaping, unicode kept
    assert '{"type": "function", "function": {"name": "météo", "description": "a <b> & c", ' \
           '"parameters": {}}}' in out


def test_llama3_prompt_has_one_bos_and_turn_tokens():
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    vocab = TEMPLATES.parent / "ggml-vocab-llama-bpe.gguf"
    if not vocab.exists():
        pytest.skip(f"llama.cpp vocab files missing in {TEMPLATES.parent}")
    md = read_gguf(vocab).metadata
    tok = Tokenizer.from_gguf(md)
    specials = special_token_strings(md)
    assert specials["bos_token"] == "<|begin_of_text|>"
    prompt = render_chat(real("meta-llama-Llama-3.1-8B-Instruct"), CONV[1:2],
                         date_string="26 Jul 2024", **specials)
    ids = encode_prompt(tok, prompt)
    assert ids[0] == tok.bos_id and ids[1] == tok.token_to_id["<|start_header_id|>"]
    assert ids.count(tok.bos_id) == 1
    assert ids.count(tok.token_to_id["<|eot_id|>"]) == 2
    assert tok.decode(ids, render_special=True) == prompt


def test_gemma2_real_template_rejects_system_role_clearly():
    tmpl = real("google-gemma-2-2b-it")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(tmpl, CONV, bos_token="<bos>")


def test_mistral_real_templates():
    assert render_chat(real("mistralai-Mistral-Nemo-Instruct-2407"), CONV, bos_token="<s>",
                       eos_token="</s>") == "<s>[INST]Hi[/INST]Hello!</s>[INST]Be brief.\n\n2+2?[/INST]"
    assert render_chat(real("Mistral-Small-3.2-24B-Instruct-2506"), CONV, bos_token="<s>",
                       eos_token="</s>") == (
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!</s>[INST]2+2?[/INST]")


def test_every_real_template_renders_a_plain_conversation():
    if not TEMPLATES.exists():
        pytest.skip(f"real chat templates missing in {TEMPLATES}")
    needs_extra = {"fireworks-ai-llama-3-firefunction-v2"}     # requires a `functions` variable
    n = 0
    for p in sorted(TEMPLATES.glob("*.jinja")):
        if p.stem in needs_extra:
            continue
        out = render_chat(p.read_text("utf-8"), CONV[1:], bos_token="<s>", eos_token="</s>")
        assert "2+2?" in out, p.name
        n += 1
    assert n >= 50


def test_multipart_content_is_flattened():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "there"}]}]
    assert render_chat(builtin_template("chatml"), msgs, add_generation_prompt=False) == \
        "<|im_start|>user\nHi there<|im_end|>\n"


# --- sandbox -----------------------------------------------------------------------------------

@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{% set x = ''.__class__ %}ok",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('id') }}",
    "{{ strftime_now.__code__ }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ 'a' * 100000000 }}",
    "{{ [1] * 100000000 }}",
    "{{ 9 ** 99999999 }}",
    # memory bombs: widths, formats, doubling strings/numbers, joins, JSON indent
    "{{ 'a'|center(2000000000) }}",
    "{{ 'a'.ljust(2000000000) }}",
    "{{ 'x'|indent(2000000000) }}",
    "{{ '%2000000000d' % 1 }}",
    "{{ '%*d' % (2000000000, 1) }}",
    "{{ '%*d'|format(2000000000, 1) }}",
    "{{ '{:>2000000000}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=2000000000) }}",
    "{{ ('a' * 1000000).replace('a', 'a' * 1000) }}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(n=10 ** 60) %}{% for i in range(40) %}"
    "{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{{ (['x' * 1000000] * 3000) | join }}",
    "{{ messages | tojson(indent=1000000000) }}",
    # CPU: nested loops that print nothing (stopped by the time budget)
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
])
def test_hostile_templates_are_stopped(template):
    with pytest.raises(ChatTemplateSecurityError):
        render_chat(template, CONV)


def test_runaway_loops_and_output_are_stopped():
    with pytest.raises(ChatTemplateError):
        render_chat("{% for i in range(10**9) %}x{% endfor %}", CONV)
    with pytest.raises(ChatTemplateSecurityError, match="too large"):
        render_chat("{% for i in range(99999) %}{{ 'x' * 1000000 }}{% endfor %}", CONV)


def test_guards_leave_ordinary_operations_alone():
    out = render_chat("{{ 'a' ~ 'b' ~ messages[0].content }}|{{ ['a', 'b'] | join(',') }}|"
                      "{{ 2 + 3 }}|{{ 'a' + 'b' }}|{{ '%5.2f' % 1.5 }}|{{ '{:>3}'.format(1) }}|"
                      "{{ 'x' | center(5) }}|{{ messages | tojson(indent=2) | length > 10 }}",
                      CONV[1:2])
    assert out == "abHi|a,b|5|ab| 1.50|  1|  x  |True"
    big = [{"role": "user", "content": "line\n" * 400_000}]      # a 2 MB message is fine
    out = render_chat("{{ messages[0].content.replace('\\n', '\\\\n') | length }}", big)
    assert out == str(400_000 * 6)
    with pytest.raises(ChatTemplateError, match="RecursionError"):
        render_chat("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", CONV)


def test_template_errors_are_one_clear_error():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for m in messages %}", CONV)
    with pytest.raises(ChatTemplateError, match="rejected the conversation: nope"):
        render_chat("{{ raise_exception('nope') }}", CONV)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[10]['content'] }}", CONV)
    with pytest.raises(ChatTemplateError, match="list of objects"):
        render_chat("x", "not a list")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        builtin_template("nope")


def test_hf_environment_features():
    tmpl = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
            "{% generation %}{{ m.role }}{% endgeneration %}\n{% endfor %}"
            "{{ {'k': 'é<'} | tojson }}")
    # trim_blocks eats the newline after {% endgeneration %}, as in transformers
    assert render_chat(tmpl, CONV) == 'systemuser{"k": "é<"}'
    # trim_blocks / lstrip_blocks as transformers sets them
    assert render_chat("  {% if true %}\nA\n  {% endif %}\nB", CONV) == "A\nB"
