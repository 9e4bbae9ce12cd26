"""`cut_at_stops` equals the plain statement of the stop rules, however the output is split into runs."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from speccycle.core import Request, SamplingParams
from speccycle.statemachine.stops import cut_at_stops, stop_text_reference
from speccycle.testing.text import PIECES, ToyDetokenizer

TEXT = ToyDetokenizer()
STOPS = ["ab", "é", "€", "a b", "b\nx", "baba", "éaé", "c"]
FEW = [PIECES.index(p) for p in (b"a", b"b", b"ab", b"ba", b"\xc3", b"\xa9", b"\xc3\xa9")]  # dense in matches


def reference_stop(output, params: SamplingParams) -> tuple[int, str] | None:
    """Token by token: the first stop id, stop string (decoding every prefix afresh) or length."""
    hit = stop_text_reference(output, params.stop_strings, TEXT) if params.stop_strings else None
    for i, token in enumerate(output):
        if token in params.stop_token_ids or hit == i:
            return i + 1, "stop"
        if i + 1 >= params.max_new_tokens:
            return i + 1, "length"
    return None


@settings(max_examples=300)
@given(
    output=st.lists(st.sampled_from(FEW) | st.integers(0, len(PIECES) - 1), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=30),
    stop_ids=st.just(()) | st.lists(st.integers(0, len(PIECES) - 1), max_size=1).map(tuple),
    stop_strings=st.lists(st.sampled_from(STOPS), min_size=1, max_size=2).map(tuple) | st.just(()),
    max_new=st.just(100) | st.integers(1, 80),
)
@example(output=[1, 0, 5, 0], cuts=[2, 1], stop_ids=(), stop_strings=("baba",), max_new=100)  # spans two runs
def test_runs_stop_where_token_by_token_decoding_stops(output, cuts, stop_ids, stop_strings, max_new):
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=stop_ids, stop_strings=stop_strings)
    expected = reference_stop(output, params)
    request, done, position = Request(0, (1,), params), None, 0
    for size in cuts * 10:  # commit the output in runs of random sizes, as cycles do
        if position >= len(output):
            break
        run = output[position : position + size]
        keep, reason = cut_at_stops(request, run, TEXT)
        assert keep == len(run) or reason is not None
        request = Request(0, (1,), params, request.output + tuple(run[:keep]))
        position += keep
        if reason is not None:
            done = (len(request.output), reason)
            break
    assert done == expected, f"{TEXT.decode(output)!r}: runs stopped at {done}, token by token at {expected}"


def test_the_token_that_completes_a_character_completes_the_stop_string():
    params = SamplingParams(max_new_tokens=10, stop_strings=("é",))
    first_half, second_half, letter = PIECES.index(b"\xc3"), PIECES.index(b"\xa9"), PIECES.index(b"a")
    request = Request(0, (1,), params)
    assert cut_at_stops(request, [letter, first_half, second_half, letter], TEXT) == (3, "stop")
    # The first half alone decodes to nothing yet, so it does not stop; the second completes "é".
    assert cut_at_stops(request, [letter, first_half], TEXT) == (2, None)
    resumed = Request(0, (1,), params, (letter, first_half))
    assert cut_at_stops(resumed, [second_half, letter], TEXT) == (1, "stop")


def test_stop_strings_without_a_detokenizer_are_refused():
    request = Request(0, (1,), SamplingParams(stop_strings=("x",)))
    with pytest.raises(ValueError, match="detokenizer"):
        cut_at_stops(request, [1], None)
