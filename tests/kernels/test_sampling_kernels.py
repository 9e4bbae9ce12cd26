"""Invariant 14 for the sampling verifies: each Triton kernel equals its torch reference under one random stream.

The uniforms are inputs, so kernel and reference see the same numbers and must commit the same
tokens (exact equality of ``accept_index``, ``accept_len`` and ``predict``). Trees are drafted as the
cycle drafts them (children drawn without replacement from the parent's ``q``, ``-1`` padding when the
draft runs out of mass), chains too, and lookup proposals as point masses (drawn with replacement,
so repeats occur). Runs on
CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is; small vocabulary blocks force several blocks.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.backends.torch import sampling as ref
from speccycle.backends.torch import sampling_tree as ref_tree

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.backends.cuda import sampling as fast  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log(0) = -inf: intended


def _target_and_draft(rows: int, vocab: int, gen: torch.Generator, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Related random ``p`` and ``q`` (the draft's logits are the target's plus noise), ``q`` truncated to
    its ``keep`` most likely tokens and ``p`` to ``keep + 2`` (zeros elsewhere). Shapes: -> ``[rows, V]`` each."""
    logits = torch.randn(rows, vocab, generator=gen) * 2
    draft_logits = logits + torch.randn(rows, vocab, generator=gen)
    return ref.process_logits(logits, 1.0, keep + 2, 1.0), ref.process_logits(draft_logits, 1.0, keep, 1.0)


def _random_parents(n: int, gen: torch.Generator, chain: bool) -> list[int]:
    if chain:
        return list(range(-1, n - 1))
    return [-1] + [int(torch.randint(0, c, (1,), generator=gen)) for c in range(1, n)]


def _case(seed: int, bs: int, n: int, vocab: int, chain: bool, point_mass: bool, keep: int):
    """A batch of drafted trees with their p, q and uniforms. Shapes as `verify_tree_sampling` takes them."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([_random_parents(n, gen, chain) for _ in range(bs)])
    p, q = (x.view(bs, n, vocab) for x in _target_and_draft(bs * n, vocab, gen, keep))
    tokens = torch.full((bs, n), -1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (bs,), generator=gen)
    for b in range(bs):
        for u in range(n):
            kids = (parents[b] == u).nonzero().flatten()
            if not len(kids):
                continue
            if point_mass:  # guesses that are often likely tokens, repeats allowed
                guesses = q[b, u].expand(len(kids), vocab)
                tokens[b, kids] = ref.sample_categorical(guesses, ref.safe_uniform((len(kids), vocab), gen))
                continue
            k = min(len(kids), vocab)
            ids = ref.sample_without_replacement(q[b, u][None], k, ref.safe_uniform((1, vocab), gen))[0]
            tokens[b, kids[:k]] = torch.where(tokens[b, u] >= 0, ids, -1)  # padding begets padding
    uniforms = ref.safe_uniform((bs, n), gen)
    noise = ref.safe_uniform((bs, vocab), gen)
    move = {"device": DEVICE}
    q = None if point_mass else q.to(**move)
    return tokens.to(**move), parents.to(**move), q, p.to(**move), uniforms.to(**move), noise.to(**move)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("seed, bs, n, vocab, keep, width, block_v", [
    (0, 6, 9, 12, 4, 4, 16),
    (1, 5, 12, 40, 3, 5, 16),  # three vocabulary blocks, frequent padding
    (2, 4, 7, 33, 33, 8, 64),  # untruncated q, width past the depth
    (3, 3, 1, 20, 5, 3, 32),  # the root alone
])  # fmt: skip
def test_tree_kernel_equals_reference(seed, bs, n, vocab, keep, width, block_v, point_mass):
    tokens, parents, q, p, uniforms, noise = _case(seed, bs, n, vocab, False, point_mass, keep)
    expected = ref_tree.verify_tree_sampling(tokens, parents, q, p, width, uniforms, noise, validate=False)
    got = fast.verify_tree_sampling(tokens, parents, q, p, width, uniforms, noise, block_v=block_v)
    for name, e, g in zip(("accept_index", "accept_len", "predict"), expected, got):
        assert torch.equal(e, g), f"{name}: reference {e.tolist()} != kernel {g.tolist()}"
    assert n == 1 or bool((expected[1] > 1).any()), "no draft accepted: the case tests little"


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("seed, bs, steps, vocab, keep, block_v", [
    (0, 8, 4, 12, 4, 16),
    (1, 6, 3, 40, 40, 16),  # three vocabulary blocks
    (2, 4, 1, 9, 2, 16),
    (3, 3, 0, 20, 5, 32),  # no drafts: the bonus alone
])  # fmt: skip
def test_chain_kernel_equals_reference(seed, bs, steps, vocab, keep, block_v, point_mass):
    tokens, _, q, p, uniforms, noise = _case(seed, bs, steps + 1, vocab, True, point_mass, keep)
    draft_q = None if q is None else q[:, :steps]
    expected = ref.verify_chain_sampling(tokens[:, 1:], draft_q, p, uniforms, noise, validate=False)
    got = fast.verify_chain_sampling(tokens[:, 1:], draft_q, p, uniforms, noise, block_v=block_v)
    for name, e, g in zip(("accept_len", "predict"), expected, got):
        assert torch.equal(e, g), f"{name}: reference {e.tolist()} != kernel {g.tolist()}"


def test_the_mixin_routes_both_verifies_to_the_kernels():
    from speccycle.backends.torch import TorchBackend

    class Backend(fast.SamplingKernels, TorchBackend):
        pass

    tokens, parents, q, p, uniforms, noise = _case(5, 4, 6, 16, 5, False, 16)
    tree = Backend().verify_tree_sampling(tokens, parents, q, p, 4, uniforms, noise)
    assert all(
        torch.equal(a, b) for a, b in zip(tree, fast.verify_tree_sampling(tokens, parents, q, p, 4, uniforms, noise))
    )
    chain_tokens, _, cq, cp, cu, cn = _case(6, 4, 4, 16, 5, False, 16)
    args = (chain_tokens[:, 1:], cq[:, :3], cp, cu, cn)
    assert all(
        torch.equal(a, b) for a, b in zip(Backend().verify_chain_sampling(*args), fast.verify_chain_sampling(*args))
    )


@pytest.mark.parametrize("count", [1, 37, fast.KEYED_BLOCK + 5])
def test_keyed_uniforms_kernel_is_the_reference_bit_for_bit(count, monkeypatch):
    """The draws' uniforms (`keyed_uniforms`, splitmix64 from each request's key): integer arithmetic, so the kernel
    returns the reference's float32 bits exactly, for keys of either sign (int64 bits read as unsigned), and the
    backend takes the kernel where Triton runs."""
    from speccycle.backends.cuda.ops import CudaBackend

    gen = torch.Generator().manual_seed(count)
    keys = torch.randint(-(2**63), 2**63 - 1, (5,), dtype=torch.long, generator=gen)
    keys[0], keys[1] = 0, -1  # all bits clear, all bits set
    keys = keys.to(DEVICE)
    want = ref.keyed_uniforms(keys, count)
    got = fast.keyed_uniforms(keys, count)
    assert got.dtype == torch.float32 and got.shape == (5, count)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert bool(((got > 0) & (got < 1)).all())
    calls = []

    def counted(keys, count):
        calls.append(count)
        return got

    monkeypatch.setattr(fast, "keyed_uniforms", counted)
    assert CudaBackend().uniforms_from_keys(keys, count) is got and calls == [count]
