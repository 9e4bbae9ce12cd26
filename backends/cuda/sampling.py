"""Triton kernels of sampling: the lossless verify and the draws' uniforms (references: `backends.torch.sampling`,
`sampling_tree`).

`keyed_uniforms`: a draw's uniforms from each request's key (splitmix64), bit for bit the torch reference's, one
program per 1,024 of a row. The verifies: one program per request. Both take the same uniforms as the
references (``uniforms [bs, N]``: row ``c``'s acceptance coin; ``sample_uniforms [bs, V]``: the final token's
Gumbel noise), so under one random stream they return the same tokens: tested equal in
``tests/kernels/test_sampling_kernels.py``.

* `verify_chain_sampling`: the ``S`` coins in order until the first rejection, then one pass for the
  residual's mass and one Gumbel-argmax pass over the vocabulary for the final (recovered or bonus) token.
* `verify_tree_sampling`: the walk of `verify_tree_sampling`, row by row. The walk's current ``p``
  (what the target still owes) and ``q`` (what the next sibling was drawn from) live in a ``[bs, V]``
  float32 scratch pair in global memory, updated in vocabulary blocks on each acceptance (copy the
  child's rows) and each rejection (residual, and ``q`` without the rejected token); a barrier after
  each update makes the block-wise writes visible to the scalar reads of the next coin.

``draft_probs=None`` is the point-mass mode of a lookup draft (``q = one_hot(x)``, no ``q`` state).
Sums run in another order than torch's, so a probability may differ in its last bit and a coin or a
Gumbel key within that distance of its threshold could fall the other way: with continuous uniforms
that has probability of order ``2**-24`` per comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch import sampling as reference
from .launch import runs_triton


@triton.jit
def _final_token(
    p_row_ptr,
    q_row_ptr,
    noise_ptr,
    x,
    rejected,
    vocab,
    POINT_MASS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One token by Gumbel-argmax, -1 when nothing has mass.

    ``RESIDUAL`` (the chain): from ``normalize(max(p - q, 0))``, ``p`` where that has no mass, with
    ``q`` zero unless ``rejected`` (`residual_distribution`); otherwise (the tree) from ``p`` as it is.
    """
    offs = tl.arange(0, BLOCK_V)
    mass = tl.zeros((), tl.float32)
    if RESIDUAL:
        for start in range(0, vocab, BLOCK_V):
            v = start + offs
            inside = v < vocab
            p = tl.load(p_row_ptr + v, mask=inside, other=0.0)
            if POINT_MASS:
                q = tl.where((v == x) & rejected, 1.0, 0.0)
            else:
                q = tl.load(q_row_ptr + v, mask=inside, other=0.0) * rejected.to(tl.float32)
            mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
    best_key = tl.full((), -float("inf"), tl.float32)
    best = tl.full((), -1, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        v = start + offs
        inside = v < vocab
        p = tl.load(p_row_ptr + v, mask=inside, other=0.0)
        if RESIDUAL:
            if POINT_MASS:
                q = tl.where((v == x) & rejected, 1.0, 0.0)
            else:
                q = tl.load(q_row_ptr + v, mask=inside, other=0.0) * rejected.to(tl.float32)
            residual = tl.maximum(p - q, 0.0)
            dist = tl.where(mass > 0, residual / tl.where(mass > 0, mass, 1.0), p)
        else:
            dist = p
        u = tl.load(noise_ptr + v, mask=inside, other=0.5)
        keys = tl.log(dist) - tl.log(-tl.log(u))
        keys = tl.where(inside, keys, -float("inf"))
        block_key = tl.max(keys, axis=0)
        block_arg = tl.argmax(keys, axis=0)  # first index of the block's maximum
        better = block_key > best_key  # strictly: an earlier block wins ties, as argmax's first index does
        best = tl.where(better, start + block_arg, best)
        best_key = tl.where(better, block_key, best_key)
    return tl.where(best_key > -float("inf"), best, -1)


# The draft depth (a shape of adaptive speculation's family: 0 with speculation off) and a tree's row count change
# between batches in serving: not specialized (an int equal to 1 would compile a kernel of its own mid-serving), nor
# the alignment of the per-request vectors, which a batch of one can pass as views at any offset (the vocabulary-wide
# rows keep theirs: their loads are the kernels' work).
@triton.jit(do_not_specialize=["num_steps"], do_not_specialize_on_alignment=["tokens_ptr", "coins_ptr"])
def _chain_kernel(
    tokens_ptr,  # [bs, S] int64
    q_ptr,  # [bs, S, V] float32 (unused for point masses)
    p_ptr,  # [bs, S + 1, V] float32
    coins_ptr,  # [bs, S + 1] float32
    noise_ptr,  # [bs, V] float32
    accept_len_ptr,  # [bs] int64
    predict_ptr,  # [bs, S + 1] int64, -1 filled
    num_steps,
    vocab,
    POINT_MASS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    steps = num_steps + tl.zeros((), tl.int64)  # an int argument equal to 1 arrives as a constant
    correct = tl.zeros((), tl.int64)
    going = tl.zeros((), tl.int32) == 0  # still accepting
    for j in range(0, num_steps):
        x = tl.load(tokens_ptr + b * steps + j)
        p_x = tl.load(p_ptr + (b * (steps + 1) + j) * vocab + x)
        if POINT_MASS:
            q_x = 1.0
        else:
            q_x = tl.load(q_ptr + (b * steps + j) * vocab + x)
        u = tl.load(coins_ptr + b * (steps + 1) + j + 1)
        going = going & (u * q_x < p_x)
        correct += going.to(tl.int64)
        tl.store(predict_ptr + b * (steps + 1) + j, x, mask=going)
    rejected = correct < steps
    row = tl.minimum(correct, tl.maximum(steps - 1, 0))
    x = tl.load(tokens_ptr + b * steps + row, mask=rejected, other=-1)
    final = _final_token(
        p_ptr + (b * (steps + 1) + correct) * vocab,
        q_ptr + (b * steps + row) * vocab,
        noise_ptr + b * vocab,
        x,
        rejected,
        vocab,
        POINT_MASS,
        True,
        BLOCK_V,
    )
    tl.store(predict_ptr + b * (steps + 1) + correct, final)
    tl.store(accept_len_ptr + b, correct + 1)


@triton.jit(do_not_specialize=["n", "width"], do_not_specialize_on_alignment=["tokens_ptr", "parents_ptr", "coins_ptr"])
def _tree_kernel(
    tokens_ptr,  # [bs, N] int64, -1 padding
    parents_ptr,  # [bs, N] int64
    q_ptr,  # [bs, N, V] float32 (unused for point masses)
    p_ptr,  # [bs, N, V] float32
    coins_ptr,  # [bs, N] float32
    noise_ptr,  # [bs, V] float32
    p_state_ptr,  # [bs, V] float32 scratch
    q_state_ptr,  # [bs, V] float32 scratch
    accept_index_ptr,  # [bs, W] int64, -1 filled
    accept_len_ptr,  # [bs] int64
    predict_ptr,  # [bs * N] int64, -1 filled
    n,
    vocab,
    width,
    POINT_MASS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = n + tl.zeros((), tl.int64)
    offs = tl.arange(0, BLOCK_V)
    p_state = p_state_ptr + b * vocab
    q_state = q_state_ptr + b * vocab
    for start in range(0, vocab, BLOCK_V):  # the walk starts at the root: p, q of row 0
        v = start + offs
        inside = v < vocab
        tl.store(p_state + v, tl.load(p_ptr + b * rows * vocab + v, mask=inside), mask=inside)
        if not POINT_MASS:
            tl.store(q_state + v, tl.load(q_ptr + b * rows * vocab + v, mask=inside), mask=inside)
    tl.debug_barrier()
    tl.store(accept_index_ptr + b * width, b * rows)
    current = tl.zeros((), tl.int64)
    length = tl.full((), 1, tl.int64)
    for c in range(1, n):
        parent = tl.load(parents_ptr + b * rows + c)
        x = tl.load(tokens_ptr + b * rows + c)
        if (parent == current) & (x >= 0) & (length < width):
            p_x = tl.load(p_state + x)
            if POINT_MASS:
                q_x = 1.0
            else:
                q_x = tl.load(q_state + x)
            u = tl.load(coins_ptr + b * rows + c)
            if u * q_x < p_x:  # accepted: the walk moves to c with c's own p and q
                tl.store(predict_ptr + b * rows + current, x)
                tl.store(accept_index_ptr + b * width + length, b * rows + c)
                current = c + tl.zeros((), tl.int64)
                length += 1
                for start in range(0, vocab, BLOCK_V):
                    v = start + offs
                    inside = v < vocab
                    row = (b * rows + c) * vocab + v
                    tl.store(p_state + v, tl.load(p_ptr + row, mask=inside), mask=inside)
                    if not POINT_MASS:
                        tl.store(q_state + v, tl.load(q_ptr + row, mask=inside), mask=inside)
            else:  # rejected: p <- residual(p, q); q <- q without x, renormalized
                mass = tl.zeros((), tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    v = start + offs
                    inside = v < vocab
                    p = tl.load(p_state + v, mask=inside, other=0.0)
                    if POINT_MASS:
                        q = tl.where(v == x, 1.0, 0.0)
                    else:
                        q = tl.load(q_state + v, mask=inside, other=0.0)
                    mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
                q_mass = tl.zeros((), tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    v = start + offs
                    inside = v < vocab
                    p = tl.load(p_state + v, mask=inside, other=0.0)
                    if POINT_MASS:
                        q = tl.where(v == x, 1.0, 0.0)
                    else:
                        q = tl.load(q_state + v, mask=inside, other=0.0)
                        q_mass += tl.sum(tl.where(v == x, 0.0, q), axis=0)
                    residual = tl.maximum(p - q, 0.0) / tl.where(mass > 0, mass, 1.0)
                    tl.store(p_state + v, tl.where(mass > 0, residual, p), mask=inside)
                if not POINT_MASS:
                    for start in range(0, vocab, BLOCK_V):
                        v = start + offs
                        inside = v < vocab
                        q = tl.where(v == x, 0.0, tl.load(q_state + v, mask=inside, other=0.0))
                        tl.store(q_state + v, q / tl.where(q_mass > 0, q_mass, 1.0), mask=inside)
            tl.debug_barrier()
    # The current p as it stands: a residual (recovered token) or the last accepted row's (bonus).
    final = _final_token(p_state, q_state, noise_ptr + b * vocab, -1, False, vocab, POINT_MASS, False, BLOCK_V)
    tl.store(predict_ptr + b * rows + current, final)
    tl.store(accept_len_ptr + b, length)


def _block_v(vocab: int) -> int:
    return min(1024, triton.next_power_of_2(max(vocab, 16)))


def verify_chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel of `speccycle.backends.torch.sampling.verify_chain_sampling` (unvalidated, as the reference with
    ``validate=False``). Shapes: ``draft_tokens [bs, S]``, ``draft_probs [bs, S, V]`` or None,
    ``target_probs [bs, S + 1, V]``, ``uniforms [bs, S + 1]``, ``sample_uniforms [bs, V]`` ->
    ``accept_len [bs]``, ``predict [bs, S + 1]``. ``block_v``: vocabulary block (a power of 2; tests force
    several blocks)."""
    bs, num_steps = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = draft_tokens.device
    point_mass = draft_probs is None
    p = target_probs.float().contiguous()
    q = p if point_mass or num_steps == 0 else draft_probs.float().contiguous()  # p: a placeholder never used
    accept_len = torch.empty(bs, dtype=torch.long, device=device)
    predict = torch.full((bs, num_steps + 1), -1, dtype=torch.long, device=device)
    if bs:
        _chain_kernel[(bs,)](
            draft_tokens.long().contiguous(),
            q,
            p,
            uniforms.float().contiguous(),
            sample_uniforms.float().contiguous(),
            accept_len,
            predict,
            num_steps,
            vocab,
            POINT_MASS=point_mass,
            BLOCK_V=block_v or _block_v(vocab),
        )
    return accept_len, predict


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_width: int,
    uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel of `speccycle.backends.torch.sampling_tree.verify_tree_sampling` (unvalidated). Shapes:
    ``tokens``, ``parents [bs, N]``, ``draft_probs [bs, N, V]`` or None, ``target_probs [bs, N, V]``,
    ``uniforms [bs, N]``, ``sample_uniforms [bs, V]`` -> ``accept_index [bs, S + 1]``, ``accept_len [bs]``,
    ``predict [bs * N]``."""
    bs, n = tokens.shape
    vocab = target_probs.shape[-1]
    device = tokens.device
    point_mass = draft_probs is None
    p = target_probs.float().contiguous()
    q = p if point_mass else draft_probs.float().contiguous()
    p_state = torch.empty((bs, vocab), dtype=torch.float32, device=device)
    q_state = p_state if point_mass else torch.empty((bs, vocab), dtype=torch.float32, device=device)
    accept_index = torch.full((bs, accept_width), -1, dtype=torch.long, device=device)
    accept_len = torch.empty(bs, dtype=torch.long, device=device)
    predict = torch.full((bs * n,), -1, dtype=torch.long, device=device)
    if bs:
        _tree_kernel[(bs,)](
            tokens.long().contiguous(),
            parents.long().contiguous(),
            q,
            p,
            uniforms.float().contiguous(),
            sample_uniforms.float().contiguous(),
            p_state,
            q_state,
            accept_index,
            accept_len,
            predict,
            n,
            vocab,
            accept_width,
            POINT_MASS=point_mass,
            BLOCK_V=block_v or _block_v(vocab),
        )
    return accept_index, accept_len, predict


# splitmix64's constants as two 32-bit halves each: a Python int past int64 is no Triton constant
_GAMMA_HI, _GAMMA_LO = divmod(reference.GAMMA, 1 << 32)
_MUL1_HI, _MUL1_LO = divmod(reference.MUL1, 1 << 32)
_MUL2_HI, _MUL2_LO = divmod(reference.MUL2, 1 << 32)
KEYED_BLOCK = 1024  # uniforms a program


@triton.jit
def _u64(hi, lo):
    return (tl.full((), hi, tl.uint64) << 32) | tl.full((), lo, tl.uint64)


@triton.jit(do_not_specialize=["count"])  # the vocabulary, K of it, or N coins: no variant per batch
def _keyed_uniforms_kernel(keys_ptr, out_ptr, count, tiny, below_one, BLOCK: tl.constexpr, GAMMA_HI: tl.constexpr,
                           GAMMA_LO: tl.constexpr, MUL1_HI: tl.constexpr, MUL1_LO: tl.constexpr,
                           MUL2_HI: tl.constexpr, MUL2_LO: tl.constexpr):  # fmt: skip
    """Program ``(block, row)``: uniforms ``block * BLOCK ..`` of the row's key, `keyed_uniforms`' bits (unsigned
    64-bit adds and multiplies wrap as the reference's int64 ones, the shifts are logical)."""
    row = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < count
    gamma = _u64(GAMMA_HI, GAMMA_LO)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    x = key + i.to(tl.uint64) * gamma + gamma
    x = (x ^ (x >> 30)) * _u64(MUL1_HI, MUL1_LO)
    x = (x ^ (x >> 27)) * _u64(MUL2_HI, MUL2_LO)
    x = x ^ (x >> 31)
    u = (x >> 40).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08  # the top 24 bits times 2**-24: exact
    u = tl.minimum(tl.maximum(u, tiny), below_one)
    tl.store(out_ptr + row.to(tl.int64) * count + i, u, mask=inside)


def keyed_uniforms(keys: torch.Tensor, count: int) -> torch.Tensor:
    """`backends.torch.sampling.keyed_uniforms` in one kernel: the same bits, one ``[m, count]`` float32 write instead
    of about fifteen int64 passes. Shapes: ``keys [m]`` int64 -> ``[m, count]`` float32."""
    keys = keys.contiguous()
    out = torch.empty((keys.shape[0], count), dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(count, KEYED_BLOCK), keys.shape[0])
    _keyed_uniforms_kernel[grid](
        keys, out, count, reference.TINY, reference.BELOW_ONE, BLOCK=KEYED_BLOCK, GAMMA_HI=_GAMMA_HI,
        GAMMA_LO=_GAMMA_LO, MUL1_HI=_MUL1_HI, MUL1_LO=_MUL1_LO, MUL2_HI=_MUL2_HI, MUL2_LO=_MUL2_LO,
    )  # fmt: skip
    return out


class SamplingKernels:
    """Mixin for a backend class: the two sampling verifies as kernels where Triton runs, else the reference.

    ``class CudaBackend(SamplingKernels, TorchBackend)`` picks these over `TorchBackend`'s methods.
    """

    def uniforms_from_keys(self, keys, count):
        """See `speccycle.backends.torch.sampling.keyed_uniforms` (`keyed_uniforms` here: the same bits)."""
        if not runs_triton(keys) or keys.dtype != torch.int64:
            return super().uniforms_from_keys(keys, count)
        return keyed_uniforms(keys, count)

    def verify_chain_sampling(self, draft_tokens, draft_probs, target_probs, uniforms, sample_uniforms):
        """See `speccycle.backends.torch.sampling.verify_chain_sampling`."""
        if not runs_triton(draft_tokens, target_probs, uniforms, sample_uniforms):
            return super().verify_chain_sampling(draft_tokens, draft_probs, target_probs, uniforms, sample_uniforms)
        return verify_chain_sampling(draft_tokens, draft_probs, target_probs, uniforms, sample_uniforms)

    def verify_tree_sampling(self, tokens, parents, draft_probs, target_probs, accept_width, uniforms, sample_uniforms):
        """See `speccycle.backends.torch.sampling_tree.verify_tree_sampling`."""
        args = (tokens, parents, draft_probs, target_probs, accept_width, uniforms, sample_uniforms)
        if not runs_triton(tokens, parents, target_probs, uniforms, sample_uniforms):
            return super().verify_tree_sampling(*args)
        return verify_tree_sampling(*args)
