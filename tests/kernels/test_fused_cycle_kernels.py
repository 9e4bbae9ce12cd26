"""Invariant 14 for the fused cycle's bookkeeping kernels (backends/cuda/cycle.py): each equals its torch twin.

Random batches (chains and trees up to depth ``S``, finished requests, stop tokens, length limits, tokens
from a small vocabulary so that walks run long and siblings repeat tokens): every output of the kernel,
buffers written and buffers left alone, equals the twin's exactly. The twins are the code the fused cycle
ran before the kernels; tests/unit/test_fused_cycle.py holds the cycle built on them equal to the state
machine and to autoregressive decoding. Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.backends.torch.ops import TorchBackend
from speccycle.testing.trees import random_parents

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.backends.cuda import cycle as ck  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = TorchBackend()


def _case(seed: int, batch: int, steps: int, topk: int, nodes: int):
    gen = torch.Generator().manual_seed(seed)
    tree = topk > 1
    parents = random_parents(gen, batch, nodes, steps) if tree else None
    vocab = 3  # few tokens: long walks, siblings with the same token
    tokens = torch.randint(vocab, (batch, nodes), generator=gen)
    predict = torch.randint(vocab, (batch, nodes), generator=gen)
    if seed % 3 == 0:  # walks that accept everything they can
        predict = tokens.roll(-1, dims=1) if not tree else predict
    slots = torch.randperm(10 * batch * nodes, generator=gen)[: batch * nodes].view(batch, nodes)
    done = torch.rand(batch, generator=gen) < 0.25
    slots = torch.where(done[:, None], -1, slots)
    return tokens, parents, predict, slots, done, gen


def _state(gen: torch.Generator, batch: int, cycles: int, max_out: int, done: torch.Tensor):
    out_len = torch.randint(0, 6, (batch,), generator=gen)
    cur = dict(
        L=torch.randint(5, 50, (batch,), generator=gen),
        done=done.clone(),
        out_len=out_len,
        cycle=torch.randint(0, cycles, (1,), generator=gen),
    )
    nxt = dict(
        L=torch.full((batch,), -7),
        root=torch.full((batch,), -7),
        done=torch.zeros(batch, dtype=torch.bool),
        out_len=torch.full((batch,), -7),
        cycle=torch.full((1,), -7),
        all_done=torch.zeros(1, dtype=torch.bool),
    )
    stops = torch.full((8,), -1)
    stops[: int(torch.randint(0, 3, (1,), generator=gen))] = torch.randint(3, (2,), generator=gen)[:1]
    log = dict(
        out=torch.full((batch, max_out + 1), -3),
        hist=torch.full((cycles, batch), -3),
        max_new=out_len + torch.randint(0, 9, (batch,), generator=gen),
        stops=stops,
    )
    return cur, nxt, log


def _extend(batch: int, width: int):
    ext = {name: torch.full((batch * width,), -9) for name in ck.EXTEND_FIELDS}
    ext["last"] = torch.full((batch,), -9)
    return ext


def _to(tree, device):
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return None if tree is None else tree.to(device)


# (B, S, K, N); S = 0: the root alone (a plain decode step through the cycle)
CONFIGS = [
    (1, 5, 1, 6),
    (3, 5, 1, 6),
    (2, 4, 2, 8),
    (3, 5, 4, 16),
    (4, 6, 4, 32),
    (1, 1, 1, 2),
    (5, 3, 3, 9),
    (4, 0, 1, 1),
]


@pytest.mark.parametrize("batch,steps,topk,nodes", CONFIGS)
@pytest.mark.parametrize("seed", range(8))
def test_accept_commit_equals_its_twin(batch, steps, topk, nodes, seed):
    tokens, parents, predict, slots, done, gen = _case(seed, batch, steps, topk, nodes)
    walk = predict if seed % 2 == 0 else torch.randint(3, predict.shape, generator=gen)  # forced walks differ
    width = steps + 1
    cur, nxt, log = _state(gen, batch, 7, 40, done)
    outputs = []
    for kernel in (False, True):
        n, lg, ext = _to(nxt, DEVICE), _to(log, DEVICE), _to(_extend(batch, width), DEVICE)
        args = [_to(t, DEVICE) for t in (tokens, parents, predict, walk, slots)]
        fn = ck.accept_commit if kernel else ck.accept_commit_torch
        fn(*args, _to(cur, DEVICE), n, lg, ext, BACKEND)
        lg["out"] = lg["out"][:, :-1]  # the bin column takes the twin's masked writes, never read
        outputs.append({k: v.cpu() for k, v in {**n, **lg, **ext}.items()})
    twin, kernel = outputs
    if topk == 1:  # a chain moves nothing: the twin leaves the move buffers alone, so does the kernel
        assert torch.equal(kernel["src"], twin["src"]) and (twin["src"] == -9).all()
    for name in twin:
        assert torch.equal(kernel[name], twin[name]), (name, kernel[name], twin[name])
    # the walk is the backend's: accepted rows follow the tree (invariant 5) and the histogram holds keep
    assert (kernel["hist"][cur["cycle"]] == kernel["out_len"] - cur["out_len"]).all()


@pytest.mark.parametrize("batch,steps,topk,nodes", CONFIGS)
def test_verify_rows_equal_their_twin(batch, steps, topk, nodes):
    tokens, parents, _, slots, _, gen = _case(11, batch, steps, topk, nodes)
    L = torch.randint(5, 50, (batch,), generator=gen)
    rows_b = batch * nodes + 3  # padding rows the kernel must leave alone
    outputs = []
    for kernel in (False, True):
        rows = dict(
            input_ids=torch.full((rows_b,), 5),
            positions=torch.full((rows_b,), 6),
            out_slots=torch.full((rows_b,), -1),
            prefix_lens=torch.full((rows_b,), 7),
            extra_slots=torch.full((rows_b, nodes), -1),
        )
        rows = _to(rows, DEVICE)
        fn = ck.verify_rows if kernel else ck.verify_rows_torch
        fn(*[_to(t, DEVICE) for t in (tokens, parents, L, slots)], steps, rows, BACKEND)
        outputs.append({k: v.cpu() for k, v in rows.items()})
    for name in outputs[0]:
        assert torch.equal(outputs[1][name], outputs[0][name]), name
    # the extra slots are the tree mask's (ancestors and self) over the verify slots
    mask = BACKEND.tree_mask(parents) if parents is not None else torch.ones(nodes, nodes).tril().bool()[None]
    expected = torch.where(mask, slots[:, None, :], -1).reshape(-1, nodes)
    assert torch.equal(outputs[1]["extra_slots"][: batch * nodes], expected)


def test_verify_rows_past_a_chains_width_attend_nothing_and_write_nothing():
    """A chain cut by `SpecConfig.draft_floor` (`DraftTree.widths`): a request's rows from its width on get prefix 0,
    no extra slot and out slot -1 (the attention kernel skips a row without keys), in the kernel and its twin; the
    rows before it are the uncut call's."""
    batch, steps = 4, 4
    nodes = steps + 1
    tokens, parents, _, slots, _, gen = _case(5, batch, steps, 1, nodes)
    L = torch.randint(5, 50, (batch,), generator=gen)
    widths = torch.tensor([1, 3, 5, 2])
    outputs = []
    for kernel, cut in ((False, None), (False, widths), (True, widths)):
        rows = _to(dict(input_ids=torch.full((batch * nodes,), 5), positions=torch.full((batch * nodes,), 6),
                        out_slots=torch.full((batch * nodes,), -1), prefix_lens=torch.full((batch * nodes,), 7),
                        extra_slots=torch.full((batch * nodes, nodes), -1)), DEVICE)  # fmt: skip
        fn = ck.verify_rows if kernel else ck.verify_rows_torch
        fn(*[_to(t, DEVICE) for t in (tokens, parents, L, slots)], steps, rows, BACKEND,
           None if cut is None else cut.to(DEVICE))  # fmt: skip
        outputs.append({k: v.cpu() for k, v in rows.items()})
    full, twin, got = outputs
    for name in twin:
        assert torch.equal(got[name], twin[name]), name
    live = (torch.arange(nodes)[None, :] < widths[:, None]).reshape(-1)
    for name in ("input_ids", "positions"):
        assert torch.equal(twin[name], full[name]), name
    for name in ("out_slots", "prefix_lens", "extra_slots"):
        assert torch.equal(twin[name][live], full[name][live]), name
    assert (twin["prefix_lens"][~live] == 0).all() and (twin["out_slots"][~live] == -1).all()
    assert (twin["extra_slots"][~live] == -1).all() and not live.all()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cycle_slots_equal_their_twin(page_size):
    gen = torch.Generator().manual_seed(page_size)
    batch, width = 3, 9
    table = torch.randperm(40, generator=gen)[: batch * width].view(batch, width)
    L = torch.randint(0, max(1, width * page_size - 20), (batch,), generator=gen)
    done = torch.tensor([False, True, False])
    offsets = torch.cat([torch.arange(6), torch.randint(0, 20, (8,), generator=gen)])
    args = [_to(t, DEVICE) for t in (table, L, done, offsets)]
    twin = ck.cycle_slots_torch(*args, page_size).cpu()
    kernel = ck.cycle_slots(*args, page_size).cpu()
    assert torch.equal(kernel, twin)
    assert (twin[1] == -1).all() and (twin[0] >= 0).all()


def test_the_flag_kernel_launches_only_from_a_gpu_into_pinned_host_memory():
    """`flag_to_host` declines (returns False, writes nothing) unless ``src`` is one CUDA element and ``dst`` one
    pinned host element: the fused cycle then copies the flag as before. On a GPU it is the cycle's last node
    (bench/results/scale_profile-H100-20261126-eefbb4f); ``test_fast_path``'s CUDA tests run cycles that end by it."""
    from speccycle.backends.cuda.cycle import flag_to_host

    src, dst = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)
    assert not flag_to_host(src, dst) and not bool(dst[0])
    assert not flag_to_host(torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool))
