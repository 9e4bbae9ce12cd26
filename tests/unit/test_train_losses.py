"""The trainer's fused cross-entropy (`train.losses.linear_cross_entropy`) equals its checkpointed reference.

Loss sum, correct count and the gradients of the LM head's input and (for EAGLE-3's own head) weight,
over several row chunks, in float32 and under bfloat16 autocast on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from speccycle.train.losses import chunked_cross_entropy_reference, linear_cross_entropy


def _case(rows: int = 37, hidden: int = 16, vocab: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[:5] = (x[:5] @ weight.t()).argmax(-1)  # some rows right, so the count is not trivially 0
    return x, weight, labels


def _run(fn, x, weight, labels, train_weight: bool):
    x = x.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(train_weight)
    loss, correct = fn(x, weight, labels)
    (loss * 0.37).backward()  # a scale, as the trainer's step weight and 1/n give
    return loss.detach(), int(correct), x.grad, weight.grad


@pytest.mark.parametrize("train_weight", [False, True], ids=["target-head", "own-head"])
def test_fused_cross_entropy_equals_the_checkpointed_reference(train_weight):
    x, weight, labels = _case()
    fused = _run(lambda a, w, y: linear_cross_entropy(a, w, y, chunk_rows=8), x, weight, labels, train_weight)
    ref = _run(
        lambda a, w, y: chunked_cross_entropy_reference(lambda h: F.linear(h, w), a, y, chunk_rows=8),
        x,
        weight,
        labels,
        train_weight,
    )
    assert fused[1] == ref[1] >= 5
    torch.testing.assert_close(fused[0], ref[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fused[2], ref[2], atol=1e-5, rtol=1e-5)
    if train_weight:
        torch.testing.assert_close(fused[3], ref[3], atol=1e-5, rtol=1e-5)
    else:
        assert fused[3] is None and ref[3] is None
    whole = F.cross_entropy(x @ weight.t(), labels, reduction="sum")  # one chunk, plain torch
    torch.testing.assert_close(fused[0], whole, atol=1e-4, rtol=1e-5)
    with torch.no_grad():  # held-out checks: no gradient work, the same numbers
        loss, correct = linear_cross_entropy(x, weight.requires_grad_(True), labels, chunk_rows=8)
    assert int(correct) == fused[1] and torch.equal(loss, fused[0])


def test_fused_cross_entropy_under_bfloat16_autocast_matches_the_reference():
    """Under autocast both run the logits GEMM in bfloat16 and the softmax in float32."""
    x, weight, labels = _case(rows=24, vocab=200, seed=1)
    weight = weight.bfloat16().float()  # representable in bfloat16: both paths see the same weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _run(lambda a, w, y: linear_cross_entropy(a, w, y, chunk_rows=10), x, weight, labels, True)
        ref = _run(
            lambda a, w, y: chunked_cross_entropy_reference(lambda h: F.linear(h, w), a, y, chunk_rows=10),
            x,
            weight,
            labels,
            True,
        )
    assert fused[1] == ref[1]
    torch.testing.assert_close(fused[0], ref[0], atol=1e-3, rtol=1e-4)
    assert fused[2].dtype == torch.float32 and fused[3].dtype == torch.float32
    torch.testing.assert_close(fused[2], ref[2], atol=2e-2, rtol=2e-2)  # bfloat16 gradient GEMMs on both sides
    torch.testing.assert_close(fused[3], ref[3], atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("train_weight", [False, True], ids=["target-head", "own-head"])
def test_fused_cross_entropy_on_cuda_at_smollm2_width(train_weight):
    """SmolLM2's LM head width (576 x 49,152), bf16 autocast as the trainer runs it: equal to the reference."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 576, generator=gen).cuda()
    weight = (torch.randn(49152, 576, generator=gen) * 0.05).bfloat16().float().cuda()
    labels = torch.randint(0, 49152, (3000,), generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = _run(lambda a, w, y: linear_cross_entropy(a, w, y, chunk_rows=1024), x, weight, labels, train_weight)
        ref = _run(
            lambda a, w, y: chunked_cross_entropy_reference(lambda h: F.linear(h, w), a, y, chunk_rows=1024),
            x,
            weight,
            labels,
            train_weight,
        )
    assert fused[1] == ref[1]
    torch.testing.assert_close(fused[0], ref[0], atol=1e-2, rtol=1e-4)
    torch.testing.assert_close(fused[2], ref[2], atol=1e-3, rtol=2e-2)
    if train_weight:
        torch.testing.assert_close(fused[3], ref[3], atol=1e-3, rtol=2e-2)
