"""OpenAI's Predicted Outputs through the API: accepted, used for drafts, output unchanged;
a malformed prediction is a 400 naming the field."""
from __future__ import annotations

import openai
import pytest

from daemon_fixture import shared_daemon  # noqa: F401  (module fixture)

MODEL = "gemma3:270m"
MESSAGES = [{"role": "user", "content": "Repeat after me: the quick brown fox jumps over "
                                        "the lazy dog, and the dog sleeps on."}]


@pytest.fixture(scope="module")
def oa(shared_daemon):  # noqa: F811
    with openai.OpenAI(base_url=shared_daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def test_prediction_leaves_the_answer_unchanged(oa):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    plain = oa.chat.completions.create(**kw).choices[0].message.content
    predicted = oa.chat.completions.create(
        prediction={"type": "content", "content": plain}, **kw).choices[0].message.content
    parts = oa.chat.completions.create(
        prediction={"type": "content", "content": [{"type": "text", "text": plain}]},
        **kw).choices[0].message.content
    assert predicted == plain and parts == plain


@pytest.mark.parametrize("prediction", [
    {"type": "audio", "content": "x"},
    {"type": "content", "content": 5},
    {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
])
def test_bad_prediction_is_a_400(oa, prediction):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                   prediction=prediction)
    assert "prediction" in str(e.value)
