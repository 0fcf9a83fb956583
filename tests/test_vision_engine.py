"""Images in the engine: image spans in prefill with bidirectional attention inside each
image, next-token logits against llama.cpp (libmtmd), the scheduler never cutting an image,
the prefix cache keyed by image content, the encoder's cache, and the load-time checks."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, RequestError, greedy
from edgeinfer.engine.images import MEDIA_MARKER, VisionError, placeholder_ids
from edgeinfer.formats.gguf_file import GGUFError
from edgeinfer.formats.image import decode_image
from edgeinfer.runners.base import ScheduledSpan

from vision_synth import noise_rgb, png_bytes, vision_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def engine(pair):
    e = Engine(str(pair[0]), EngineConfig(kv_budget_bytes=16 << 20), mmproj=str(pair[1]))
    yield e
    e.close()


def _img(seed: int, hw=(64, 64)):
    return decode_image(png_bytes(noise_rgb(*hw, seed=seed)))


def _msgs(*parts):
    return [{"role": "user", "content": "".join(parts)}]


def _prompt(engine, text: str, images):
    """Raw text with markers, as libmtmd tokenizes it (BOS, specials parsed)."""
    from edgeinfer.engine.images import splice_images
    from edgeinfer.formats.chat_template import encode_prompt
    first = encode_prompt(engine.tokenizer, text.partition(MEDIA_MARKER)[0])
    return splice_images(engine.tokenizer, text, [engine.vision.encode(i) for i in images],
                         first, engine.vision.layout)


def _logits(engine, ids, spans, rid=1000):
    r = engine.runner
    r._images[rid] = tuple(spans)
    try:
        nb = -(-len(ids) // r.kv_plan.block_size)
        return r.forward([ScheduledSpan(rid, 0, tuple(ids), tuple(range(nb)), True)])[0]
    finally:
        r._images.pop(rid, None)


@pytest.mark.parametrize("text,n", [
    (f"hello {MEDIA_MARKER} world", 1),
    (f"a {MEDIA_MARKER} and {MEDIA_MARKER} the", 2),
])
def test_logits_after_images_match_llamacpp(pair, engine, text, n):
    """Token layout (<start_of_image>, 16 image tokens, <end_of_image>) and the next-token
    logits after the prompt match llama.cpp's libmtmd on the same files."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from mtmd_oracle import as_layout, layout_and_logits
    images = [_img(3 + i, (64, 40 + 30 * i)) for i in range(n)]
    ids, spans = _prompt(engine, text, images)
    flat, want = layout_and_logits(str(pair[0]), str(pair[1]), text, [i.rgb for i in images])
    assert as_layout(ids) == flat
    got = _logits(engine, ids, spans)
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
    assert got.argmax() == want.argmax()


def test_torch_backend_logits_match_llamacpp(pair):
    """The torch backend: embeddings spliced in, the attention mask open to the whole image."""
    pytest.importorskip("torch")
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from mtmd_oracle import MtmdOracle
    e = Engine(str(pair[0]), EngineConfig(backend="torch:cpu", kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        text = f"a {MEDIA_MARKER} and {MEDIA_MARKER} the"
        images = [_img(31), _img(32, (30, 64))]
        ids, spans = _prompt(e, text, images)
        o = MtmdOracle(str(pair[0]), str(pair[1]))
        try:
            want = o.next_logits(text, [i.rgb for i in images])
        finally:
            o.close()
        got = _logits(e, ids, spans)
        np.testing.assert_allclose(got, want, atol=3e-3 * np.abs(want).max(), rtol=0)
        out = e.generate(ids, greedy(2), images=spans)
        assert out.token_ids[0] == want.argmax()
    finally:
        e.close()


def test_chunked_prefill_never_cuts_an_image(pair):
    """A 16-token step budget: the scheduler cuts before the image and takes it whole, and
    the output equals an unchunked run's."""
    text = f"the w1 w2 w3 w4 w5 w6 w7 w8 {MEDIA_MARKER} the a"
    img = _img(7)
    outs = []
    for step in (512, 16):
        e = Engine(str(pair[0]), EngineConfig(kv_budget_bytes=16 << 20,
                                              max_tokens_per_step=step, max_running_seqs=1),
                   mmproj=str(pair[1]))
        try:
            ids, spans = _prompt(e, text, [img])
            seen = []
            orig = e.runner.forward

            def spy(spans_, hidden_of=()):
                seen.extend((s.start, s.end) for s in spans_ if not s.is_decode)
                return orig(spans_, hidden_of)
            e.runner.forward = spy
            out = e.generate(ids, greedy(4, logprobs=0), images=spans)
            a, b = spans[0].start, spans[0].end
            assert all(not (s < b and a < en and (s > a or en < b)) for s, en in seen), seen
            outs.append(out)
        finally:
            e.close()
    assert outs[0].token_ids == outs[1].token_ids
    np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-3)


def test_prefix_cache_keys_blocks_by_image(engine):
    """The same image again reuses its KV blocks and the encoder output; another image at
    the same place reuses only the text before it."""
    a, b = _img(11), _img(12)
    words = " ".join(f"w{i}" for i in range(40))
    text = f"{words} {MEDIA_MARKER} what is it"
    ids_a, spans_a = _prompt(engine, text, [a])
    hits = engine.vision.cache_hits
    ids_a2, spans_a2 = _prompt(engine, text, [a])
    assert engine.vision.cache_hits == hits + 1 and ids_a2 == ids_a
    ids_b, spans_b = _prompt(engine, text, [b])
    assert ids_b != ids_a and placeholder_ids(b.digest, 16) == ids_b[spans_b[0].start:spans_b[0].end]
    assert len(set(ids_a[spans_a[0].start:spans_a[0].end])) == 16     # one id per position
    first = engine.generate(ids_a, greedy(2), images=spans_a)
    again = engine.generate(ids_a2, greedy(2), images=spans_a2)
    other = engine.generate(ids_b, greedy(2), images=spans_b)
    bs = engine.runner.kv_plan.block_size
    start = spans_a[0].start
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens >= (spans_a[0].end // bs) * bs > start
    assert other.num_cached_tokens <= start


def test_refusals(pair, engine, tmp_path):
    img = _img(1)
    with pytest.raises(RequestError, match="prompt logprobs"):
        ids, spans = _prompt(engine, f"x {MEDIA_MARKER}", [img])
        engine.submit(ids, greedy(1), lambda o: None, images=spans, prompt_logprobs=1)
    ids, spans = _prompt(engine, f"x {MEDIA_MARKER}", [img])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit(ids, greedy(1), lambda o: None)       # placeholders without images
    with pytest.raises(RequestError, match="markers"):
        engine.encode_chat_images(_msgs("no marker here"), [img])
    # a text-only vocabulary, a projector of another width, a text model as projector
    from edgeinfer.formats.synthetic_vision import write_tiny_mmproj
    import synth
    text_only = synth.write_model(tmp_path / "plain.gguf", "gemma3")
    with pytest.raises(VisionError, match="not a vision model"):
        Engine(str(text_only), EngineConfig(kv_budget_bytes=8 << 20), mmproj=str(pair[1]))
    wide = write_tiny_mmproj(tmp_path / "wide.gguf", 512)
    with pytest.raises(GGUFError, match="another model"):
        Engine(str(pair[0]), EngineConfig(kv_budget_bytes=8 << 20), mmproj=str(wide))
    with pytest.raises(GGUFError, match="not a vision projector"):
        Engine(str(pair[0]), EngineConfig(kv_budget_bytes=8 << 20), mmproj=str(pair[0]))
    plain = Engine(str(pair[0]), EngineConfig(kv_budget_bytes=8 << 20))
    try:
        with pytest.raises(RequestError, match="no vision projector"):
            plain.encode_chat_images(_msgs(MEDIA_MARKER), [img])
    finally:
        plain.close()


def test_batch_mixes_image_and_text_requests(engine):
    """Continuous batching: an image request and text requests in the same steps give each
    the tokens it gets alone."""
    img = _img(21, (40, 64))
    ids_i, spans = _prompt(engine, f"the a {MEDIA_MARKER} is", [img])
    ids_t = engine.encode_raw("the w3 w4 a of and")
    alone_i = engine.generate(ids_i, greedy(6), images=spans).token_ids
    alone_t = engine.generate(ids_t, greedy(6)).token_ids
    got: dict[int, list[int]] = {}

    def sink(o):
        got.setdefault(o.request_id, []).extend(o.token_ids)
    a = engine.submit(ids_t, greedy(6), sink)
    b = engine.submit(ids_i, greedy(6), sink, images=spans)
    c = engine.submit(ids_t, greedy(6), sink)
    engine._drain_commands()
    mixed = 0
    while engine.scheduler.has_work():
        out = engine.step()
        if len({ch.seq.seq_id for ch in out.chunks}) > 1:
            mixed += 1
    assert mixed > 0
    assert got[b] == alone_i and got[a] == got[c] == alone_t


def test_llamacpp_backend_takes_images(pair):
    """The llama.cpp runner: libmtmd encodes the image against the runner's own model, the
    image rows decode non-causally as embeddings; the first token and its logprob are
    llama.cpp's own (libmtmd's helper on the same files)."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from mtmd_oracle import MtmdOracle
    e = Engine(str(pair[0]), EngineConfig(backend="llamacpp", kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        assert e.vision is not None and e.vision._external is not None
        text = f"hello {MEDIA_MARKER} world"
        img = _img(41, (50, 64))
        ids, spans = _prompt(e, text, [img])
        out = e.generate(ids, greedy(3, logprobs=0), images=spans)
        o = MtmdOracle(str(pair[0]), str(pair[1]))
        try:
            want = o.next_logits(text, [img.rgb])
        finally:
            o.close()
        lp = want - want.max()
        lp = lp - np.log(np.exp(lp).sum())
        assert out.token_ids[0] == int(want.argmax())
        assert abs(out.logprobs[0] - lp[out.token_ids[0]]) < 1e-3
        # the same image again: llama.cpp's slot reuse skips the image's positions
        again = e.generate(ids, greedy(3), images=spans)
        assert again.token_ids == out.token_ids and again.num_cached_tokens >= spans[0].end
    finally:
        e.close()


def test_penalties_and_dry_ignore_image_placeholders(engine):
    """Repeat/frequency penalties and DRY over a prompt with images: the sampler's history
    is the text (a placeholder id never indexes the logits)."""
    from edgeinfer.runners.sampling_params import SamplingParams
    img = _img(51)
    ids, spans = _prompt(engine, f"the the {MEDIA_MARKER} the the", [img])
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=8, repeat_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2, dry_multiplier=0.8)
    out = engine.generate(ids, p, images=spans)
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) >= 1
    assert all(0 <= t < engine.cfg.vocab_size for t in out.token_ids)


def test_preempted_image_request_recomputes_the_same(pair):
    """A pool too small for three image requests at once: some are preempted and recomputed
    from their prompt (image spans included) and still give their solo tokens."""
    e = Engine(str(pair[0]), EngineConfig(kv_budget_bytes=560 << 10, speculative=False),
               mmproj=str(pair[1]))
    try:
        import dataclasses
        # admission keeps no room for output: the three start together and must give way
        e.scheduler.config = dataclasses.replace(e.scheduler.config, output_reserve=0)
        prompts = [_prompt(e, f"w{i} {MEDIA_MARKER} the", [_img(60 + i)]) for i in range(3)]
        solo = [e.generate(ids, greedy(60), images=sp).token_ids for ids, sp in prompts]
        got: dict[int, list[int]] = {}
        rids = [e.submit(ids, greedy(60), lambda o: got.setdefault(o.request_id, []).extend(
            o.token_ids), images=sp) for ids, sp in prompts]
        e._drain_commands()
        preempted = 0
        while e.scheduler.has_work():
            preempted += len(e.step().preempted)
        assert preempted > 0, "the pool was large enough: no preemption exercised"
        assert [got[r] for r in rids] == solo
    finally:
        e.close()


def test_q8_0_kv_cache_with_images(pair, engine):
    """A q8_0 KV pool (rotated, 8-bit blocks): the image rows read it back through the same
    dequantization; the first token and its logprob stay those of the f16 pool."""
    img = _img(71)
    ids, spans = _prompt(engine, f"the a {MEDIA_MARKER} is", [img])
    ref = engine.generate(ids, greedy(1, logprobs=0), images=spans)
    e = Engine(str(pair[0]), EngineConfig(kv_budget_bytes=16 << 20, kv_cache_type="q8_0"),
               mmproj=str(pair[1]))
    try:
        ids2, spans2 = _prompt(e, f"the a {MEDIA_MARKER} is", [img])
        out = e.generate(ids2, greedy(1, logprobs=0), images=spans2)
    finally:
        e.close()
    assert out.token_ids == ref.token_ids
    assert abs(out.logprobs[0] - ref.logprobs[0]) < 0.05
