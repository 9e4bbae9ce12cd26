"""Every fusion the table declares (`statemachine.table.FUSIONS`) leaves what the rows it replaces leave.

`accept_commit` does, in one op, the greedy walk of the verify row, the accept row (gather, cut at stops,
bonus) and the compact row (commit, a tree's KV moves, the draft extend's rows), and marks the requests the
retire row will take. Random batches (``S``, ``K``, ``N``, ``P``, batch size, a few tokens so that walks run
long and siblings repeat tokens, stop tokens, length limits, requests that finish in the cycle and requests
finished before it): the op's torch twin and its Triton kernel (through the interpreter on a CPU, as is on a
GPU) against `transitions.verify`'s walk, `transitions.accept` and `transitions.compact` run on the same
values, compared on what both produce: the committed tokens, the accept lengths, the next ``L`` and root,
which requests finished, the target KV after the moves, and the draft extend's rows.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speccycle.backends.cuda import cycle
from speccycle.backends.torch import TorchBackend
from speccycle.core import Ports, SpecConfig
from speccycle.core.config import SamplingParams
from speccycle.core.records import DraftTree, Request, RowOutputs, Verified
from speccycle.core.shapes import chain_parents
from speccycle.statemachine import table
from speccycle.statemachine import transitions as t
from speccycle.testing.trees import random_parents

BACKEND = TorchBackend()
VOCAB = 3  # few tokens: long walks, siblings with the same token
FEATURES = 5
MAX_STOPS = 8
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_fusion_names_rows_and_ops_of_the_table():
    """A fusion names table rows and, of those rows' ops, the ones it does; its module holds the op beside its
    torch twin; each fusion has its property test here."""
    assert table.FUSIONS
    for fusion in table.FUSIONS:
        assert fusion.rows and all(row in table.TABLE for row in fusion.rows), fusion.op
        declared = {op for row in fusion.rows for op in row.ops}
        assert set(fusion.replaces_ops) <= declared, set(fusion.replaces_ops) - declared
        assert all(fusion in table.fusions_of(row) for row in fusion.rows)
        module = importlib.import_module(fusion.module)
        assert callable(getattr(module, fusion.op)) and callable(getattr(module, fusion.op + "_torch"))
        assert f"test_{fusion.op}_twin_leaves_what_the_rows_leave" in globals(), fusion.op


class _Port:
    """What `transitions.accept` and `transitions.compact` read of the ports: the target's KV buffers, a shifted
    forward draft (extend rows at ``L + d``, the target's features of each row)."""

    kind, pairing, device = "forward", "shifted", torch.device("cpu")

    def __init__(self, buffers):
        self.buffers = buffers

    def target_buffers(self):
        return self.buffers


@st.composite
def cycles(draw):
    steps = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 3))
    if topk == 1:
        nodes = steps + 1
    else:
        nodes = draw(st.integers(2, min(topk + (steps - 1) * topk * topk, 12) + 1))
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    batch = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    stops = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2, unique=True))
    finished_before = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    history = draw(st.lists(st.integers(1, 6), min_size=batch, max_size=batch))  # output so far (root included)
    room = draw(st.lists(st.integers(1, 8), min_size=batch, max_size=batch))  # max_new_tokens - output so far
    accept_all = draw(st.booleans())  # predictions equal to the first-child path's tokens: long runs
    config = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=nodes, page_size=page_size)
    return config, batch, seed, tuple(stops), finished_before, history, room, accept_all


def _case(config: SpecConfig, batch: int, seed: int, accept_all: bool):
    """Tokens, parents (None: a chain), predictions, the pool's pages and each request's ``L``."""
    gen = torch.Generator().manual_seed(seed)
    S, N, P = config.num_steps, config.num_draft_tokens, config.page_size
    tokens = torch.randint(VOCAB, (batch, N), generator=gen)
    if config.is_chain:
        parents = None
    else:
        parents = random_parents(gen, batch, N, S)
    predict = torch.randint(VOCAB, (batch, N), generator=gen)
    if accept_all:  # each row predicts its first child's token (the chain: the next row's)
        for b in range(batch):
            for i in range(N):
                children = [j for j in range(N) if (j == i + 1 if parents is None else parents[b, j] == i)]
                if children:
                    predict[b, i] = tokens[b, children[0]]
    L = torch.randint(3, 40, (batch,), generator=gen)
    width = -(-(int(L.max()) + N + 1) // P)
    pages = torch.randperm(batch * width + 3, generator=gen)[: batch * width].view(batch, width)
    slots = pages.gather(1, (L[:, None] + torch.arange(N)) // P) * P + (L[:, None] + torch.arange(N)) % P
    buffers = [torch.randn((batch * width + 3) * P, 2, generator=gen) for _ in range(2)]
    features = torch.randn(batch * N, FEATURES, generator=gen)
    return tokens, parents, predict, slots, L, buffers, features


def _table_rows(config, requests, tokens, parents, predict, slots, L, buffers, features):
    """The verify row's greedy walk, then the accept and compact rows, on the live requests' values."""
    bs, N = tokens.shape
    if parents is None:
        tree_parents = chain_parents(bs, N, tokens.device)
        accept_index, accept_len = BACKEND.verify_greedy_chain(tokens, predict, config.accept_width)
    else:
        tree_parents = parents
        accept_index, accept_len = BACKEND.verify_greedy(tokens, parents, predict, config.accept_width)
    verified = Verified(
        config=config,
        requests=requests,
        seq_lens=L,
        tree=DraftTree(tokens=tokens, parents=tree_parents, depths=torch.zeros_like(tokens)),
        verify_slots=slots,
        rows=RowOutputs(predict=predict.reshape(-1), hidden=features),
        accept_index=accept_index,
        accept_len=accept_len,
    )
    port = _Port(buffers)
    ports = Ports(target=port, draft=port, kv_pool=port)
    accepted = t.accept(verified, ports, BACKEND)
    return t.compact(accepted, ports, BACKEND)


def _fused(op, config, tokens, parents, predict, slots, L, done, history, max_new, stops, buffers):
    """The fused op over the whole batch (finished requests included), then its KV moves applied."""
    B, W = tokens.shape[0], config.accept_width
    long = dict(dtype=torch.long)
    cur = dict(L=L.clone(), done=done.clone(), out_len=torch.tensor(history), cycle=torch.tensor([2]))
    nxt = dict(L=torch.full((B,), -7), root=torch.full((B,), -7), done=torch.zeros(B, dtype=torch.bool),
               out_len=torch.full((B,), -7), cycle=torch.full((1,), -7),
               all_done=torch.zeros(1, dtype=torch.bool))  # fmt: skip
    width = max(history) + max(max_new) + W + 1
    log = dict(out=torch.full((B, width + 1), -3), hist=torch.full((4, B), -3), max_new=torch.tensor(max_new),
               stops=torch.tensor(list(stops) + [-1] * (MAX_STOPS - len(stops))))  # fmt: skip
    ext = {name: torch.full((B * W,), -5, **long) for name in cycle.EXTEND_FIELDS}
    ext["last"] = torch.full((B,), -5, **long)
    on = [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (tokens, parents, predict, slots)]
    dicts = [{k: v.to(DEVICE) for k, v in d.items()} for d in (cur, nxt, log, ext)]
    op(on[0], on[1], on[2], on[2], on[3], *dicts, BACKEND)
    cur, nxt, log, ext = [{k: v.cpu() for k, v in d.items()} for d in dicts]
    moved = [b.clone() for b in buffers]
    if parents is not None:
        ok = (ext["src"] >= 0) & (ext["dst"] >= 0)
        for buf in moved:
            buf[ext["dst"][ok]] = buf[ext["src"][ok]].clone()
    return nxt, log, ext, moved


def _check_fusion(op, case) -> None:
    config, batch, seed, stops, finished_before, history, room, accept_all = case
    tokens, parents, predict, slots, L, buffers, features = _case(config, batch, seed, accept_all)
    done = torch.tensor(finished_before)
    max_new = [h + r for h, r in zip(history, room)]
    nxt, log, ext, moved = _fused(op, config, tokens, parents, predict, slots, L, done, history, max_new, stops,
                                  buffers)  # fmt: skip
    W = config.accept_width
    live = [b for b in range(batch) if not finished_before[b]]
    # finished requests: nothing committed, nothing written, the state carried over
    for b in range(batch):
        if finished_before[b]:
            assert int(log["hist"][2, b]) == 0 and bool(nxt["done"][b])
            assert int(nxt["L"][b]) == int(L[b]) and int(nxt["out_len"][b]) == history[b]
            assert bool((log["out"][b, :-1] == -3).all())  # the last column: the bin for masked writes
            if parents is not None:
                assert bool((ext["src"][b * W : (b + 1) * W] == -1).all())
    assert bool(nxt["all_done"][0]) == bool(nxt["done"].all()) and int(nxt["cycle"][0]) == 3
    if not live:
        assert all(torch.equal(a, b) for a, b in zip(moved, buffers))
        return
    # the table's rows over the live requests (a finished request left the batch at the retire row)
    index = torch.tensor(live)
    requests = tuple(
        Request(b, (1, 2), SamplingParams(max_new_tokens=max_new[b], stop_token_ids=stops), output=(0,) * history[b])
        for b in live
    )
    N = config.num_draft_tokens
    rows = (index[:, None] * N + torch.arange(N)).reshape(-1)
    table_buffers = [b.clone() for b in buffers]
    compacted = _table_rows(
        config, requests, tokens[index], None if parents is None else parents[index], predict[index], slots[index],
        L[index], table_buffers, features[rows],
    )  # fmt: skip
    for i, (b, request) in enumerate(zip(live, compacted.requests)):
        keep = int(compacted.accept_len[i])
        committed = request.output[history[b] :]
        assert keep == len(committed) == int(log["hist"][2, b]), (b, keep, committed)
        assert log["out"][b, history[b] : history[b] + keep].tolist() == list(committed)
        assert bool((log["out"][b, history[b] + keep : -1] == -3).all())  # nothing written past the run
        assert int(nxt["L"][b]) == int(compacted.seq_lens[i]) and int(nxt["out_len"][b]) == len(request.output)
        assert int(nxt["root"][b]) == int(compacted.root_tokens[i])  # the bonus, read at stride S + 1
        assert bool(nxt["done"][b]) == (request.finish_reason is not None), (b, request.finish_reason)
        assert int(ext["last"][b]) == b * W + keep - 1
        # the draft extend's rows d < keep: token, position L + d, the slot of L + d, the row's target features
        extend = [j for j in range(len(compacted.extend.row_request)) if int(compacted.extend.row_request[j]) == i]
        assert len(extend) == keep
        for d, j in enumerate(extend):
            e = b * W + d
            assert int(ext["input_ids"][e]) == int(compacted.extend.input_ids[j]) == committed[d]
            assert int(ext["positions"][e]) == int(compacted.extend.positions[j]) == int(L[b]) + d
            assert int(ext["prefix_lens"][e]) == int(L[b]) + d + 1
            assert int(ext["out_slots"][e]) == int(slots[b, d])
            assert torch.equal(features[ext["feature_rows"][e]], compacted.extend.hidden[j])
        # rows past the run: a slot of the request's own block or none (a tree of N < S + 1 rows)
        block = set(slots[b].tolist()) | {-1}
        assert all(int(s) in block for s in ext["out_slots"][b * W : (b + 1) * W])
    # the target KV after the moves: the same in every slot (a chain moves nothing)
    for got, want in zip(moved, table_buffers):
        assert torch.equal(got, want)


@given(cycles())
def test_accept_commit_twin_leaves_what_the_rows_leave(case):
    _check_fusion(cycle.accept_commit_torch, case)


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
@settings(max_examples=10)
@given(cycles())
def test_accept_commit_kernel_leaves_what_the_rows_leave(case):
    _check_fusion(cycle.accept_commit, case)
