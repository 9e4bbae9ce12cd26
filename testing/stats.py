"""Goodness-of-fit helpers for the statistical tests of lossless sampling (no scipy needed)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expecting < 5 are pooled. Asserts no zero-probability cell.

    Shapes: ``counts [C]``, ``probs [C]`` -> p-value.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    probs = probs / probs.sum()
    assert counts[probs <= 0].sum() == 0, "a token of target probability 0 was committed"
    n = counts.sum()
    expected, observed = probs[probs > 0] * n, counts[probs > 0]
    small = expected < 5
    if bool(small.any()):
        pool_e, pool_o = expected[small].sum(), observed[small].sum()
        expected, observed = expected[~small], observed[~small]
        if pool_e < 5 and expected.numel():  # still too small: merge it into the smallest regular cell
            i = int(expected.argmin())
            expected[i] += pool_e
            observed[i] += pool_o
        else:
            expected = torch.cat([expected, pool_e[None]])
            observed = torch.cat([observed, pool_o[None]])
    df = expected.numel() - 1
    if df < 1:
        return 1.0
    return chi_square_sf(float(((observed - expected) ** 2 / expected).sum()), df)


def chi_square_sf(stat: float, df: int) -> float:
    """``P(chi2_df >= stat)``: the regularized upper incomplete gamma ``Q(df / 2, stat / 2)``."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def one_percent_noncentrality(probs: torch.Tensor) -> float:
    """Chi-square noncentrality per sample of moving mass 0.01 from the most likely cell to the second.

    Of all moves of 0.01 between two cells it is the one the test sees worst; ``n`` samples give
    noncentrality ``n`` times this. Shapes: ``probs [C]``.
    """
    top = probs.double().flatten().topk(2).values
    return 1e-4 * float(1 / top[0] + 1 / top[1])


def shift_one_percent(samples: torch.Tensor, probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A 1%-distorted sampler: moves mass 0.01 from the most likely cell to the second.

    Shapes: ``samples [M]`` cell indices, ``probs [C]`` -> ``[M]``.
    """
    first, second = probs.flatten().topk(2).indices.tolist()
    flip = (samples == first) & (torch.rand(samples.shape, generator=gen) < 0.01 / float(probs.flatten()[first]))
    return torch.where(flip, second, samples)
