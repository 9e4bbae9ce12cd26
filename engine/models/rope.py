"""RoPE frequencies: Hugging Face's default ones, and the ``linear`` and ``llama3`` scalings of a config.

A RoPE table is built from a model's ``config.rope_theta`` wherever the model runs (`llama.rope_cos_sin`, the
fast path's tables, the draft heads built for a target). A scaled model's ``rope_theta`` is a `ScaledRopeBase`:
a float equal to the base that also carries the scaling, as transformers 5 keeps the base and its scaling
together in ``rope_parameters``. So every table made from it gets the scaled frequencies; a plain float
gives the default ones, bitwise as before.

* ``linear``: every frequency divided by ``factor`` (positions interpolated).
* ``llama3`` (Llama 3.1 and later): frequencies whose wavelength is under ``original_max_position / high_freq_factor``
  are kept, those above ``original_max_position / low_freq_factor`` divided by ``factor``, and those between
  interpolated smoothly between the two, in float32 op for op as transformers computes them.

``dynamic`` (NTK) is refused: transformers recomputes the frequencies of a whole forward from the longest
position in it, which a batch of requests at different lengths cannot reproduce.

A GGUF file of a Llama 3.1 model carries its ``llama3`` scaling as one divisor per frequency
(``rope_freqs.weight``, llama.cpp's form: frequency ``i`` is divided by ``factors[i]``). `scaling_from_freq_factors`
reads the ``llama3`` parameters back from them and checks that they give the same frequencies.

    theta = rope_base_from_hf(raw_config_json, "config.json")   # a float, or a ScaledRopeBase
    inv_freq = rope_inv_freq(head_dim, theta)                   # [head_dim / 2] float32
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from ..errors import ModelLoadError

SCALING_TYPES = ("linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@attrs.frozen
class RopeScaling:
    """A RoPE scaling of a Hugging Face config: ``rope_type`` (`SCALING_TYPES`) and its parameters."""

    rope_type: str = attrs.field(validator=attrs.validators.in_(SCALING_TYPES))
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position: int | None = None  # llama3 only: the context the model was pretrained at

    def __attrs_post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.rope_type == "llama3":
            if None in (self.low_freq_factor, self.high_freq_factor, self.original_max_position):
                raise ValueError("llama3 RoPE scaling needs low_freq_factor, high_freq_factor, original_max_position")
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor} and {self.high_freq_factor}"
                )
            if self.original_max_position <= 0:
                raise ValueError(f"original_max_position_embeddings must be positive, got {self.original_max_position}")

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict of a config.json (transformers 4 and 5 both read it)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position,
            )
        return out


class ScaledRopeBase(float):
    """A RoPE base (its float value) with the `RopeScaling` its frequencies take (module docstring).

    Equal to another only with the same scaling; pickles, copies and hashes with it. ``float(x)`` is the base.
    """

    scaling: RopeScaling

    def __new__(cls, base: float, scaling: RopeScaling) -> ScaledRopeBase:
        value = super().__new__(cls, base)
        value.scaling = scaling
        return value

    def __getnewargs__(self) -> tuple[float, RopeScaling]:
        return float(self), self.scaling

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ScaledRopeBase):
            return float(self) == float(other) and self.scaling == other.scaling
        return NotImplemented if not isinstance(other, (int, float)) else False

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((float(self), self.scaling))

    def __repr__(self) -> str:
        return f"ScaledRopeBase({float(self)!r}, {self.scaling!r})"


def rope_scaling(theta: float) -> RopeScaling | None:
    """The scaling ``theta`` carries (None: the default frequencies)."""
    return theta.scaling if isinstance(theta, ScaledRopeBase) else None


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """The inverse frequencies of RoPE over ``head_dim``, scaled as ``theta`` says. Shape ``[head_dim / 2]`` float32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (float(theta) ** exponent)  # [D / 2]
    scaling = rope_scaling(theta)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's band scaling, in transformers' float32 order of operations (so the tables agree bitwise)."""
    long_wavelength = s.original_max_position / s.low_freq_factor  # above: divided by factor
    short_wavelength = s.original_max_position / s.high_freq_factor  # below: kept
    wavelength = 2 * math.pi / inv_freq  # [D / 2]
    outside = torch.where(wavelength > long_wavelength, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - smooth) * outside / s.factor + smooth * outside
    in_band = ~(wavelength < short_wavelength) * ~(wavelength > long_wavelength)
    return torch.where(in_band, between, outside)


def rope_base_from_hf(raw: dict[str, Any], source: str, default_theta: float = 10000.0) -> float:
    """The RoPE base of a Hugging Face ``config.json`` dict: a float, or a `ScaledRopeBase` when it is scaled.

    Reads transformers 4's ``rope_theta`` + ``rope_scaling`` and transformers 5's ``rope_parameters``.
    """
    parameters = dict(raw.get("rope_parameters") or {})
    parameters.update(raw.get("rope_scaling") or {})
    base = float(raw.get("rope_theta", parameters.get("rope_theta", default_theta)))
    rope_type = parameters.get("rope_type", parameters.get("type")) or "default"
    if rope_type == "default":
        return base
    if rope_type not in SCALING_TYPES:
        why = (
            " (dynamic NTK rescales every position of a forward by the longest one in it, which a batch of "
            "requests at different lengths cannot reproduce)"
            if rope_type == "dynamic"
            else ""
        )
        raise ModelLoadError(
            f"{source}: RoPE scaling {rope_type!r} is not supported; supported: default, "
            f"{', '.join(SCALING_TYPES)}{why}"
        )
    try:
        if rope_type == "linear":
            scaling = RopeScaling("linear", float(parameters["factor"]))
        else:
            factor, low, high = (float(parameters[key]) for key in _LLAMA3_KEYS)
            original = int(parameters["original_max_position_embeddings"])
            scaling = RopeScaling("llama3", factor, low, high, original)
    except KeyError as error:
        raise ModelLoadError(f"{source}: {rope_type} RoPE scaling has no {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{source}: {rope_type} RoPE scaling: {error}") from error
    return ScaledRopeBase(base, scaling)


def scaling_from_freq_factors(
    factors: torch.Tensor,
    head_dim: int,
    base: float,
    source: str,
    original_max_position: int | None = None,
) -> RopeScaling | None:
    """The `RopeScaling` whose frequencies are the default ones divided by ``factors [head_dim / 2]`` (a GGUF's
    ``rope_freqs.weight``): None for factors all 1, ``linear`` for one factor throughout, else ``llama3``.

    In the ``llama3`` band between the kept and the divided frequencies, ``1 / factors[i] = (1 - s) / factor + s``
    with ``s = (original / wavelength - low) / (high - low)``, linear in ``1 / wavelength``: two interpolated
    frequencies give its slope and intercept. ``original_max_position`` (a GGUF's
    ``rope.scaling.original_context_length``) fixes the three parameters; without it ``low_freq_factor`` is taken
    as 1 (Llama 3.1's). The parameters found must give the factors' frequencies within float32 rounding, else a
    `ModelLoadError` says so."""
    factors = factors.double().reshape(-1)
    if factors.numel() != head_dim // 2 or not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
        raise ModelLoadError(
            f"{source}: rope_freqs.weight holds {factors.numel()} values for a head dimension of {head_dim}: expected "
            f"{head_dim // 2} positive per-frequency factors"
        )
    if bool((factors == 1).all()):
        return None
    factor = float(factors.max())
    if bool((factors == factors[0]).all()):
        return RopeScaling("linear", factor)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim
    wavelength = 2 * math.pi * base**exponent
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if int(band.sum()) < 2:
        raise ModelLoadError(
            f"{source}: rope_freqs.weight interpolates {int(band.sum())} frequencies: the llama3 RoPE parameters "
            "cannot be read from fewer than 2; convert the model with its config.json (a Hugging Face folder)"
        )
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)  # s of each interpolated frequency
    design = torch.stack([1 / wavelength[band], torch.ones_like(smooth)], 1)
    slope, intercept = torch.linalg.lstsq(design, smooth[:, None]).solution[:, 0].tolist()
    try:
        if original_max_position is None:
            original = round(-slope / intercept)  # low = 1: high - low = -1 / intercept, original = slope (high - low)
        else:
            original = int(original_max_position)
        width = original / slope  # high - low
        low = -intercept * width
        scaling = RopeScaling("llama3", factor, round(low, 6), round(low + width, 6), original)
    except (ValueError, ZeroDivisionError, OverflowError) as error:
        raise ModelLoadError(
            f"{source}: rope_freqs.weight holds per-frequency factors that no llama3 RoPE scaling gives ({error}); "
            "convert the model with its config.json (a Hugging Face folder)"
        ) from error
    expected = rope_inv_freq(head_dim, float(base)).double() / factors
    found = rope_inv_freq(head_dim, ScaledRopeBase(float(base), scaling)).double()
    if not torch.allclose(found, expected, rtol=1e-5, atol=0):
        raise ModelLoadError(
            f"{source}: rope_freqs.weight holds per-frequency factors that no llama3 RoPE scaling gives (closest: "
            f"{scaling.to_hf()}); convert the model with its config.json (a Hugging Face folder)"
        )
    return scaling
