"""The prompt-lookup draft's proposals, token for token (engine/drafters/ngram.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speccycle.engine.drafters.ngram import CPU_OPTIONS, NgramDraft

VOCAB = 50


def chain(draft: NgramDraft, history: list[int], steps: int) -> list[int]:
    tokens, parents = draft.propose([0], [history], num_steps=steps, num_nodes=steps, topk=1)
    assert parents.tolist() == [list(range(tokens.shape[1]))]
    return tokens[0].tolist()


def test_a_repeated_run_proposes_a_full_continuation():
    # The best match ends one token before the end (period 1): it proposes the run, not one token.
    draft = NgramDraft(VOCAB)
    assert chain(draft, [5, 7, 7, 7, 7], steps=5) == [7, 7, 7, 7, 7]
    assert draft.matches([5, 7, 7, 7, 7])[0].tolist() == [3, 2, 1]  # ends, longest match first
    assert draft.matches([5, 7, 7, 7, 7])[1].tolist() == [3, 2, 1]  # their lengths


def test_a_periodic_history_continues_with_its_period():
    # "2 3 2 3 2": the longest match (length 3) ends 2 tokens back, so the text repeats "3 2".
    assert chain(NgramDraft(VOCAB), [1, 2, 3, 2, 3, 2], steps=5) == [3, 2, 3, 2, 3]


def test_the_longest_match_wins_over_a_more_recent_one():
    # suffix "... 1 2 3": "1 2 3" at the start (length 3) beats "2 3" later (length 2)
    history = [9, 1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3]
    assert chain(NgramDraft(VOCAB), history, steps=3) == [4, 8, 2]
    assert chain(NgramDraft(VOCAB, max_ngram=2), history, steps=3) == [5, 1, 2]  # both saturate at 2: recency


def test_equally_long_matches_vote_on_the_next_token():
    # Three one-token matches of 4: two are followed by 1, the most recent by 2; 1 wins, and of the
    # two the more recent (ending at index 2) supplies the continuation.
    assert chain(NgramDraft(VOCAB), [4, 1, 4, 1, 4, 2, 4], steps=3) == [1, 4, 2]


def test_the_draft_depth_follows_the_match_length():
    history = [3, 1, 2, 9, 9, 9, 9, 6, 1, 2]  # the best match "1 2" has length 2
    assert chain(NgramDraft(VOCAB), history, steps=6) == [9, 9, 9, 9, 6, 1]
    assert chain(NgramDraft(VOCAB, depth_per_match=1.0), history, steps=6) == [9, 9]
    assert chain(NgramDraft(VOCAB, depth_per_match=1.5), history, steps=6) == [9, 9, 9]
    assert chain(NgramDraft(VOCAB, depth_per_match=2.0), history, steps=3) == [9, 9, 9]  # at most S
    assert chain(NgramDraft(VOCAB, min_ngram=3), history, steps=6) == []  # too weak: nothing
    assert chain(NgramDraft(VOCAB, depth_per_match=1.0, min_depth=3), history, steps=6) == [9, 9, 9]
    assert chain(NgramDraft(VOCAB, depth_per_match=1.0, min_depth=3), history, steps=2) == [9, 9]  # at most S


def test_no_match_proposes_nothing_and_a_batch_pads_to_its_widest_guess():
    draft = NgramDraft(VOCAB)
    tokens, parents = draft.propose([0, 1], [[5, 7, 7, 7, 7], [1, 2, 3]], num_steps=3, num_nodes=3, topk=1)
    assert tokens.tolist() == [[7, 7, 7], [3, 3, 3]]  # request 1 has no match: its last token, rejected
    assert parents.tolist() == [[0, 1, 2], [0, 1, 2]]
    tokens, parents = draft.propose([0], [[1, 2, 3]], num_steps=3, num_nodes=3, topk=1)
    assert tokens.shape == parents.shape == (1, 0)  # a one-row verify


def test_a_tree_merges_distinct_continuations_best_first():
    # matches of 4, best first: end 2 (-> 1 4), end 0 (-> 1 4, a duplicate), end 4 (-> 2 4, period 2)
    tokens, parents = NgramDraft(VOCAB).propose([0], [[4, 1, 4, 1, 4, 2, 4]], num_steps=2, num_nodes=4, topk=2)
    assert tokens.tolist() == [[1, 4, 2, 4]]
    assert parents.tolist() == [[0, 1, 0, 3]]  # row 0 is the root
    tokens, parents = NgramDraft(VOCAB).propose([0], [[4, 1, 4, 1, 4, 2, 4]], num_steps=2, num_nodes=3, topk=2)
    assert tokens.tolist() == [[1, 4, 2]] and parents.tolist() == [[0, 1, 0]]  # node budget


def test_for_device_picks_the_measured_cpu_options():
    cpu = NgramDraft.for_device(VOCAB, "cpu")
    assert (cpu.min_ngram, cpu.depth_per_match, cpu.min_depth) == (
        CPU_OPTIONS["min_ngram"],
        CPU_OPTIONS["depth_per_match"],
        CPU_OPTIONS["min_depth"],
    )
    gpu = NgramDraft.for_device(VOCAB, "cuda")
    assert (gpu.min_ngram, gpu.depth_per_match) == (1, None)
    assert NgramDraft.for_device(VOCAB, "cpu", max_ngram=4, min_ngram=1).max_ngram == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 5, "max_ngram": 4}, "min_ngram"),
        ({"max_matches": 0}, "max_matches"),
        ({"depth_per_match": 0.0}, "depth_per_match"),
        ({"min_depth": 0}, "min_depth"),
    ],
)
def test_invalid_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramDraft(VOCAB, **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    steps=st.integers(1, 6),
    topk=st.integers(1, 3),
    nodes=st.integers(1, 12),
    depth_per_match=st.sampled_from([None, 1.0, 2.0]),
)
def test_proposals_keep_the_lookup_contract_and_copy_the_history(history, steps, topk, nodes, depth_per_match):
    """Parents precede their node, depth <= S, at most N - 1 nodes; a chain is what followed a match."""
    num_nodes = steps if topk == 1 else nodes
    draft = NgramDraft(VOCAB, depth_per_match=depth_per_match)
    tokens, parents = draft.propose([0], [history], steps, num_nodes, topk)
    assert tokens.shape == parents.shape and tokens.shape[1] <= num_nodes and tokens.dtype == torch.long
    depth = [0]
    for i, parent in enumerate(parents[0].tolist()):
        assert 0 <= parent <= i
        depth.append(depth[parent] + 1)
    assert max(depth) <= steps
    if topk == 1 and tokens.shape[1]:
        end, _ = (int(x[0]) for x in draft.matches(history))
        period = len(history) - 1 - end
        extended = history + [history[len(history) - period + i % period] for i in range(steps)]
        assert tokens[0].tolist() == extended[end + 1 : end + 1 + tokens.shape[1]]
