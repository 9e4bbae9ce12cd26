"""Cross-entropy through an LM head over many rows: a fused forward-and-gradient path and its reference.

Both compute, for ``x [N, H]`` (the LM head's input, normed), ``weight [V, H]`` and ``labels [N]``:

* ``loss_sum = sum_n (logsumexp(l_n) - l_n[labels_n])`` with ``l = x @ weight.T`` (``F.cross_entropy``,
  ``reduction="sum"``), differentiable in ``x`` and (when it requires grad) ``weight``;
* ``correct = #{n : argmax l_n == labels_n}``.

An EAGLE-1 head (and EAGLE-3 over the target's LM head) has ``V = 49,152`` on SmolLM2: one draft step
of a training batch has ~16k such rows, so the ``[N, V]`` logits never exist whole; both paths walk
row chunks.

`chunked_cross_entropy_reference` is the trainer's former path: per chunk a checkpointed
``F.cross_entropy`` over float32 logits, so the backward runs the logits GEMM and the softmax again,
and autograd keeps and walks float32 ``[C, V]`` tensors for the cast, the log-softmax and its
gradient.

`linear_cross_entropy` is the fast one. The gradient of the summed cross-entropy with respect to the
logits is ``softmax(l) - onehot(label)``, known as soon as the forward has the logits, so the forward
computes it per chunk and multiplies it straight into ``grad_x = g @ W`` (and ``grad_W += g.T @ x``):
the logits GEMM runs once in the compute dtype (bfloat16 under autocast), the log-sum-exp, argmax and
softmax run in float32 on the chunk, ``g`` is cast back to the compute dtype for its GEMMs (as
autocast's linear backward would), and only ``grad_x [N, H]`` (float32) is kept for the backward,
which scales it by the incoming gradient. No recomputation, no saved ``[C, V]`` tensor. Its labels
must all be real ids (no ``ignore_index``): the caller leaves out the rows it does not train.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


def _chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int,
    dtype: torch.dtype,
    want_x: bool,
    want_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Loss sum, correct count and (when wanted) ``grad_x [N, H]``, ``grad_w [V, H]`` float32 at grad 1."""
    w = weight.to(dtype)
    loss = x.new_zeros((), dtype=torch.float32)
    correct = x.new_zeros((), dtype=torch.long)
    grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device) if want_x else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_w else None
    for start in range(0, x.shape[0], chunk_rows):
        xc = x[start : start + chunk_rows].to(dtype)
        yc = labels[start : start + chunk_rows]
        logits = F.linear(xc, w).float()  # [C, V]; a copy unless the compute dtype is float32
        lse = torch.logsumexp(logits, -1)  # [C]
        loss = loss + (lse - logits.gather(1, yc[:, None])[:, 0]).sum()
        correct = correct + (logits.argmax(-1) == yc).sum()
        if not (want_x or want_w):
            continue
        g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
        g.scatter_add_(1, yc[:, None], g.new_full((g.shape[0], 1), -1.0))  # minus the one-hot label
        g = g.to(dtype)
        if want_x:
            grad_x[start : start + chunk_rows] = (g @ w).float()
        if want_w:
            grad_w += (g.t() @ xc).float()
    return loss, correct, grad_x, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk_rows, dtype):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            loss, correct, grad_x, grad_w = _chunks(x, weight, labels, chunk_rows, dtype, want_x, want_w)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss.float()
        gx = None if grad_x is None else (grad_x * scale).to(ctx.x_dtype)
        gw = None if grad_w is None else (grad_w * scale).to(ctx.w_dtype)
        return gx, gw, None, None, None


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, correct)`` of ``x [N, H] @ weight.T [H, V]`` against ``labels [N]`` (all valid ids).

    ``loss_sum`` float32, differentiable in ``x`` and ``weight`` (the gradient is computed in the
    forward, see the module docstring); ``correct`` int64. Under autocast the GEMMs run in the
    autocast dtype; otherwise in the promoted dtype of ``x`` and ``weight``.
    """
    dtype = _compute_dtype(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, labels, chunk_rows, dtype)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        loss, correct, _, _ = _chunks(x, weight, labels, chunk_rows, dtype, False, False)
    return loss, correct


def _ce_chunk(logits_fn: Callable, hidden: torch.Tensor, labels: torch.Tensor):
    logits = logits_fn(hidden).float()
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return loss, (logits.argmax(-1) == labels).sum()


def chunked_cross_entropy_reference(
    logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The former path: ``logits_fn(hidden chunk)`` -> float32 -> ``F.cross_entropy``, checkpointed per chunk.

    ``labels`` may hold ``-100`` (ignored: no loss, never correct). Kept as the reference the fast
    path is tested against and for ``bench/train_step_profile.py`` to time beside it.
    """
    loss = hidden.new_zeros((), dtype=torch.float32)
    correct = hidden.new_zeros((), dtype=torch.long)
    for chunk, chunk_labels in zip(hidden.split(chunk_rows), labels.split(chunk_rows)):
        if torch.is_grad_enabled():
            part, hits = checkpoint(_ce_chunk, logits_fn, chunk, chunk_labels, use_reentrant=False)
        else:
            part, hits = _ce_chunk(logits_fn, chunk, chunk_labels)
        loss, correct = loss + part, correct + hits
    return loss, correct
