"""Images through every API of a real daemon, with the official clients: OpenAI chat
`image_url` parts, Ollama `images` on /api/chat and /api/generate, Anthropic `image` blocks,
Responses `input_image`; the 400s (an http URL, a corrupt image, a text-only model, a
format we do not take); /api/show's `vision` capability. The model is the synthetic Gemma 3
text model with its mmproj (tests/vision_synth.py), stored together in the daemon's store."""
from __future__ import annotations

import base64

import httpx
import pytest

from daemon_fixture import start_daemon
from vision_synth import noise_rgb, png_bytes, vision_pair

VISION, PLAIN = "gemma3-vision:tiny", "gemma3-plain:tiny"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from edgeinfer.store.bundled_listing import MARKER
    from edgeinfer.store.model_store import Store
    text, mmproj = vision_pair(tmp_path_factory.mktemp("vision-files"))
    home = tmp_path_factory.mktemp("vision-home")
    store = Store(home)
    store.register_file(text, VISION)
    store.attach_projector(VISION, mmproj)
    store.register_file(text, PLAIN)            # the same blob, no projector
    (home / MARKER).touch()
    d = start_daemon(home, EDGEINFER_MAX_MODEL_LEN="512")
    try:
        yield d
    finally:
        d.stop()


def _png(seed: int = 1) -> bytes:
    return png_bytes(noise_rgb(48, 64, seed=seed))


def _b64(seed: int = 1) -> str:
    return base64.b64encode(_png(seed)).decode()


def _data_url(seed: int = 1) -> str:
    return "data:image/png;base64," + _b64(seed)


@pytest.fixture(scope="module")
def oai(daemon):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_openai_image_url(oai):
    r = oai.chat.completions.create(
        model=VISION, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is in"},
            {"type": "image_url", "image_url": {"url": _data_url(1)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": _data_url(2), "detail": "low"}}]}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens > 2 * (16 + 2)          # two images of 16 tokens + tags
    # the same request again: its image blocks come from the prefix cache
    again = oai.chat.completions.create(
        model=VISION, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is in"},
            {"type": "image_url", "image_url": {"url": _data_url(1)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": _data_url(2), "detail": "low"}}]}])
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_openai_refusals(oai, daemon):
    import openai
    bad = [
        ("https://example.com/cat.png", "http"),
        ("data:image/png;base64," + base64.b64encode(_png()[:60]).decode(), "corrupt"),
        ("data:image/png;base64,@@@@", "base64"),
        ("data:image/tiff;base64," + base64.b64encode(b"II*\x00" + b"\0" * 64).decode(),
         "not an image"),
    ]
    for url, words in bad:
        with pytest.raises(openai.BadRequestError, match=words):
            oai.chat.completions.create(
                model=VISION, max_tokens=2,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}]}])
    with pytest.raises(openai.BadRequestError, match="text-only"):
        oai.chat.completions.create(
            model=PLAIN, max_tokens=2,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url()}}]}])
    # the daemon keeps serving
    r = oai.chat.completions.create(model=VISION, max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens == 2


def test_ollama_images(daemon):
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=daemon.url, timeout=300)
    r = c.chat(model=VISION, options={"temperature": 0, "num_predict": 3},
               messages=[{"role": "user", "content": "describe", "images": [_png(3)]}])
    assert r.done and r.eval_count == 3 and r.prompt_eval_count > 16
    g = c.generate(model=VISION, prompt="describe", images=[_b64(3)],
                   options={"temperature": 0, "num_predict": 3})
    assert g.done and g.eval_count == 3
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=PLAIN, messages=[{"role": "user", "content": "x", "images": [_png()]}])
    assert e.value.status_code == 400 and "text-only" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=VISION, prompt="x", images=[base64.b64encode(b"junk").decode()])
    assert e.value.status_code == 400
    show = c.show(VISION)
    assert "vision" in show.capabilities
    assert "vision" not in c.show(PLAIN).capabilities


def test_anthropic_image_block(daemon):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0,
                             timeout=300) as ac:
        r = ac.messages.create(model=VISION, max_tokens=3, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {
                                       "type": "base64", "media_type": "image/png",
                                       "data": _b64(4)}},
                                   {"type": "text", "text": "what is this?"}]}])
        assert r.stop_reason == "max_tokens" and r.usage.input_tokens > 16
        n = ac.messages.count_tokens(model=VISION, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": _b64(4)}},
            {"type": "text", "text": "what is this?"}]}])
        assert n.input_tokens == r.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError, match="http"):
            ac.messages.create(model=VISION, max_tokens=3, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])


def test_responses_input_image(oai):
    r = oai.responses.create(model=VISION, max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": _data_url(5)}]}])
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 16
    # a follow-up keeps the first turn's image
    r2 = oai.responses.create(model=VISION, max_output_tokens=2, temperature=0,
                              previous_response_id=r.id, input="and its colour?")
    assert r2.usage.input_tokens > r.usage.input_tokens


def test_oversized_image_refused(daemon):
    from edgeinfer.formats.image import MAX_IMAGE_BYTES
    big = base64.b64encode(b"\x89PNG" + b"\0" * (MAX_IMAGE_BYTES + 10)).decode()
    r = httpx.post(daemon.url + "/api/chat", timeout=120, json={
        "model": VISION, "stream": False,
        "messages": [{"role": "user", "content": "x", "images": [big]}]})
    assert r.status_code == 400 and "limit" in r.json()["error"]


def test_image_urls_fetched_only_when_allowed(tmp_path_factory):
    """serve --allow-image-urls (EDGEINFER_ALLOW_IMAGE_URLS=1): http(s) image URLs are
    fetched (a missing one is a 400 naming the status); without it they are refused."""
    openai = pytest.importorskip("openai")
    from edgeinfer.store.bundled_listing import MARKER
    from edgeinfer.store.model_store import Store
    from httpfault import FaultServer
    text, mmproj = vision_pair(tmp_path_factory.mktemp("vision-files-2"))
    home = tmp_path_factory.mktemp("vision-home-2")
    Store(home).register_file(text, VISION)
    Store(home).attach_projector(VISION, mmproj)
    (home / MARKER).touch()
    d = start_daemon(home, EDGEINFER_MAX_MODEL_LEN="512", EDGEINFER_ALLOW_IMAGE_URLS="1")
    try:
        with FaultServer() as web:
            web.add("/cat.png", _png(8))
            oai = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0,
                                timeout=300)

            def ask(url):
                return oai.chat.completions.create(
                    model=VISION, max_tokens=2, temperature=0,
                    messages=[{"role": "user", "content": [
                        {"type": "text", "text": "what?"},
                        {"type": "image_url", "image_url": {"url": url}}]}])
            fetched = ask(web.url + "/cat.png")
            inline = ask(_data_url(8))
            assert fetched.choices[0].message.content == inline.choices[0].message.content
            assert inline.usage.prompt_tokens_details.cached_tokens >= 16   # same image
            with pytest.raises(openai.BadRequestError, match="HTTP 404"):
                ask(web.url + "/missing.png")
    finally:
        d.stop()


def test_n_choices_share_the_image_prefill(oai):
    """n = 2: the second choice waits for the first's prefill and takes its image blocks
    from the prefix cache; both see the image (greedy: the same text)."""
    r = oai.chat.completions.create(
        model=VISION, max_tokens=3, temperature=0, n=2,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(9)}},
            {"type": "text", "text": "describe"}]}])
    assert len(r.choices) == 2
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_broken_projector_is_a_clear_load_error(daemon, oai, tmp_path):
    """A projector that broke after it was stored: the load fails with one sentence naming
    it, nothing stays loaded half-way, and the daemon keeps serving."""
    import os
    import openai
    from edgeinfer.formats.synthetic_vision import write_tiny_mmproj
    from edgeinfer.store.model_store import Store
    store = Store(daemon.home)
    text = store.resolve(VISION).path
    other = write_tiny_mmproj(tmp_path / "other.gguf", 256, seed=11)
    store.register_file(text, "gemma3-broken:tiny")
    ref = store.attach_projector("gemma3-broken:tiny", other)
    blob = ref.projector_path
    os.chmod(blob, 0o644)
    data = blob.read_bytes()
    blob.write_bytes(data[:len(data) // 3])            # truncated on disk
    with pytest.raises(openai.InternalServerError, match="cannot load gemma3-broken:tiny"):
        oai.chat.completions.create(model="gemma3-broken:tiny", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    ps = daemon.get("/api/ps").json()["models"]
    assert all(m["name"] != "gemma3-broken:tiny" for m in ps)
    r = oai.chat.completions.create(model=VISION, max_tokens=2, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(2)}}]}])
    assert r.usage.completion_tokens == 2


def test_vision_figures_in_stats_and_metrics(daemon, oai):
    """/api/stats and /metrics count encoded images, encoder-cache hits and encode time."""
    for _ in range(2):
        oai.chat.completions.create(model=VISION, max_tokens=1, messages=[{
            "role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": _data_url(33)}}]}])
    m = next(x for x in daemon.stats()["models"] if x["name"] == VISION)
    v = m["vision"]
    assert v["projector"] == "gemma3" and v["images_encoded"] >= 1
    assert v["image_cache_hits"] >= 1 and v["encode_seconds"] > 0
    text = daemon.get("/metrics").text
    assert f'edgeinfer_images_encoded_total{{model="{VISION}"' in text
    assert "edgeinfer_image_cache_hits_total" in text
