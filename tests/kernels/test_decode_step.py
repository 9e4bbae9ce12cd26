"""Invariant 14 for the decode step's bookkeeping kernels (`engine.kernels.decode_step`): each equals its torch
twin exactly (integers), padding rows and page sizes 1 to 16 included; and a graph-stepped decode with
the fused step gives the tokens of the plain one (tests/unit/test_fast_path.py covers the tokens
against greedy decoding). Runs on CPU under ``TRITON_INTERPRET=1`` and on a GPU as is."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.engine.kernels import decode_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("rows,valid", [(1, 1), (8, 1), (8, 0), (6, 6), (12, 5)])
def test_decode_rows_equal_torch(page_size, rows, valid):
    gen = torch.Generator().manual_seed(rows * 31 + page_size + valid)
    width = 9
    table = torch.randint(0, 50, (rows + 3, width), generator=gen)
    table[:, -2:] = -1  # unused pages
    positions = torch.randint(0, (width - 2) * page_size, (rows,), generator=gen)
    positions[valid:] = 0  # padding rows sit at position 0
    positions[0] = min(int(positions[0]), (width - 2) * page_size - 1)
    num_valid = torch.tensor([valid])
    args = [t.to(DEVICE) for t in (positions, num_valid, table)]
    want = decode_step.decode_rows_torch(*args, page_size)
    got = decode_step.decode_rows_triton(*args, page_size)
    for w, g in zip(want, got):
        assert g.dtype == torch.long and torch.equal(w, g)
    assert (got[1][valid:] == -1).all() and (got[2][valid:] == 0).all()


@pytest.mark.parametrize("rows,valid,step", [(1, 1, 0), (8, 1, 5), (8, 8, 3), (12, 7, 9)])
def test_decode_advance_equals_torch(rows, valid, step):
    gen = torch.Generator().manual_seed(rows + 7 * step)
    max_steps = 10
    next_ids = torch.randint(0, 49152, (rows,), generator=gen).to(DEVICE)
    positions = torch.randint(0, 500, (rows,), generator=gen).to(DEVICE)
    step_in = torch.tensor([step], device=DEVICE)
    num_valid = torch.tensor([valid], device=DEVICE)
    outs = {}
    for name, fn in (("torch", decode_step.decode_advance_torch), ("triton", decode_step.decode_advance_triton)):
        ids_out = torch.full((rows + 2,), -5, dtype=torch.long, device=DEVICE)
        pos_out = torch.full((rows + 2,), -5, dtype=torch.long, device=DEVICE)
        step_out = torch.full((1,), -5, dtype=torch.long, device=DEVICE)
        history = torch.full((rows + 2, max_steps), -5, dtype=torch.long, device=DEVICE)
        fn(next_ids, positions, step_in, num_valid, ids_out[:rows], pos_out[:rows], step_out, history[:rows])
        outs[name] = (ids_out, pos_out, step_out, history)
    for w, g in zip(outs["torch"], outs["triton"]):
        assert torch.equal(w, g)
    ids_out, pos_out, step_out, history = outs["triton"]
    assert torch.equal(history[:rows, step], next_ids) and int(step_out) == step + 1
    assert (history[rows:] == -5).all() and (ids_out[rows:] == -5).all()  # rows past the view untouched
    assert torch.equal(pos_out[:rows] - positions, (torch.arange(rows, device=DEVICE) < valid).long())


def test_vocab_argmax_equals_torch_with_ties():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    logits[2, 10] = logits[2, 250] = logits[2].max() + 1  # a tie: the first index wins
    logits[5] = float("-inf")
    logits = logits.to(DEVICE)
    assert torch.equal(decode_step.vocab_argmax(logits), logits.argmax(dim=-1))
