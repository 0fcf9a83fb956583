"""StopMatcher: stop strings caught across arbitrary token splits, nothing after emitted."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.engine.stops import StopMatcher, stop_token_set


def run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool, int]:
    """Feed pieces; return (all emitted text, stopped, index of the piece that stopped)."""
    out, at = [], -1
    for i, p in enumerate(pieces):
        emit, stopped = matcher.push(p)
        out.append(emit)
        if stopped and at == -1:
            at = i
    out.append(matcher.flush())
    return "".join(out), matcher.stopped, at


def expected_cut(text: str, stops: list[str], pieces: list[str] | None = None
                 ) -> tuple[str, bool]:
    """The spec. Text is cut before the first occurrence of any stop string, where "the
    text" is what had been generated when a stop first completed: generation ends at the
    piece (token) that completes a stop, so later text never exists."""
    ends = [len(text)]
    if pieces is not None:
        ends, n = [], 0
        for p in pieces:
            n += len(p)
            ends.append(n)
    for end in ends:
        seen = text[:end]
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            return seen[:min(hits)], True
    return text, False


def test_stop_split_across_many_tokens():
    m = StopMatcher(["</answer>"])
    text, stopped, at = run(m, ["The answer is 4", "<", "/", "ans", "wer", ">", " junk"])
    assert (text, stopped, at) == ("The answer is 4", True, 5)
    assert m.matched == "</answer>"


def test_holds_back_only_possible_prefix():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.held == "ST"
    # The held text turns out not to be a stop: it is released with the next piece.
    assert m.push("AR") == ("STAR", False)
    assert m.push("x") == ("x", False)
    assert m.flush() == ""


def test_flush_releases_partial_prefix_at_end():
    m = StopMatcher(["\n\n"])
    assert m.push("line\n") == ("line", False)
    assert m.flush() == "\n"


def test_earliest_stop_wins_and_nothing_after():
    m = StopMatcher(["world", "lo w"])
    emit, stopped = m.push("hello world")
    assert (emit, stopped) == ("hel", True)
    assert m.matched == "lo w"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


def test_empty_stop_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def test_stop_token_set():
    assert stop_token_set([5], [1, 106], ignore_eos=False) == {1, 5, 106}
    assert stop_token_set([5], [1, 106], ignore_eos=True) == {5}


ALPHABET = "ab\nxé"  # small alphabet so stop strings actually occur


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_random_splits_emit_text_before_first_stop(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    m = StopMatcher(stops)
    emitted, stopped, at = run(m, pieces)
    want, want_stopped = expected_cut(text, stops, pieces)
    assert emitted == want
    assert stopped == want_stopped
    if not any(a in b for a in stops for b in stops if a != b):
        # Without nested stop strings the split points do not matter at all.
        assert (emitted, stopped) == expected_cut(text, stops)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_emitted_prefix_never_contains_stop_start(text, stops, cuts):
    """At every step the text emitted so far is a prefix of the final answer."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    want, _ = expected_cut(text, stops, pieces)
    m = StopMatcher(stops)
    so_far = ""
    for p in pieces:
        emit, _ = m.push(p)
        so_far += emit
        assert want.startswith(so_far)
