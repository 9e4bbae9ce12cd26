"""A Mamba-style selective-state-space mixer over a `RecurrentPool`, for chains and trees.

    xs, z  = in_proj(x)                        # [T, Di] each
    xc     = silu(conv1d(xs))                  # causal depthwise, width W, along each row's ancestor path
    dt, B, C = x_proj(xc)                      # input-dependent: dt [T, Di] (softplus of dt_proj), B, C [T, Ns]
    h_t    = exp(dt_t A) h_parent + dt_t xc_t B_t ;  y_t = h_t C_t + D xc_t
    out    = out_proj(y * silu(z))

Both the convolution window (``conv``, the last ``W - 1`` inputs) and the scan state (``ssm``) are
recurrent state: a row continues its *parent's* (`RecurrentPool.plan` says which), so the tree verify
of one forward gives every row the state its root-to-row path would give, and a prefill is the chain
case. The scan runs the Triton kernel on CUDA and the torch reference elsewhere.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ...backends.torch import recurrent as torch_recurrent
from ..memory.recurrent_pool import RecurrentPool, ScanPlan


@attrs.frozen
class MambaConfig:
    """Sizes of one mixer: ``d_inner`` (``Di``) channels, ``d_state`` (``Ns``), conv width ``d_conv`` (``W``)."""

    d_model: int
    d_inner: int
    d_state: int = 8
    d_conv: int = 4
    dt_rank: int = 8

    def __attrs_post_init__(self) -> None:
        for name in ("d_model", "d_inner", "d_state", "d_conv", "dt_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"MambaConfig.{name}={getattr(self, name)} must be >= 1")
        if self.d_conv < 2:
            raise ValueError(f"MambaConfig.d_conv={self.d_conv} must be >= 2 (a width-1 conv keeps no state)")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The recurrent state of one layer, for `RecurrentPool`."""
        return {"conv": (self.d_inner, self.d_conv - 1), "ssm": (self.d_inner, self.d_state)}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self
        return {
            "in_proj.weight": (2 * c.d_inner, c.d_model),
            "conv1d.weight": (c.d_inner, c.d_conv),
            "conv1d.bias": (c.d_inner,),
            "x_proj.weight": (c.dt_rank + 2 * c.d_state, c.d_inner),
            "dt_proj.weight": (c.d_inner, c.dt_rank),
            "dt_proj.bias": (c.d_inner,),
            "A_log": (c.d_inner, c.d_state),
            "D": (c.d_inner,),
            "out_proj.weight": (c.d_model, c.d_inner),
        }


def random_mamba_weights(config: MambaConfig, generator: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    """Random weights with Mamba's usual ranges: ``A = -[1..Ns]``, ``dt`` in about ``[1e-3, 1e-1]``, ``D = 1``."""
    weights = {}
    for name, shape in config.weight_shapes().items():
        weights[name] = torch.randn(shape, generator=generator) * scale
    weights["A_log"] = (
        torch.log(torch.arange(1, config.d_state + 1, dtype=torch.float32)).expand(config.d_inner, -1).clone()
    )
    low, high = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(low + torch.rand(config.d_inner, generator=generator) * (high - low))
    weights["dt_proj.bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    weights["D"] = torch.ones(config.d_inner)
    return weights


def scan_for(device: torch.device):
    """The selective-scan implementation for ``device``: the Triton kernel on CUDA, else the reference."""
    if device.type == "cuda":
        try:
            from ...backends.cuda.recurrent import selective_scan_tree

            return selective_scan_tree
        except ImportError:  # no triton: the reference runs on any device
            pass
    return torch_recurrent.selective_scan_tree


class MambaMixer(nn.Module):
    """One mixer; its recurrent state is layer ``state_layer`` of the pool it is run with."""

    def __init__(self, config: MambaConfig, weights: dict[str, torch.Tensor], prefix: str, state_layer: int) -> None:
        super().__init__()
        self.config, self.state_layer = config, state_layer
        for name, shape in config.weight_shapes().items():
            tensor = weights[prefix + name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{prefix}{name} has shape {tuple(tensor.shape)}, expected {shape}")
        w = {name: weights[prefix + name] for name in config.weight_shapes()}
        self.in_proj = nn.Parameter(w["in_proj.weight"], requires_grad=False)
        self.conv_weight = nn.Parameter(w["conv1d.weight"], requires_grad=False)
        self.conv_bias = nn.Parameter(w["conv1d.bias"], requires_grad=False)
        self.x_proj = nn.Parameter(w["x_proj.weight"], requires_grad=False)
        self.dt_proj = nn.Parameter(w["dt_proj.weight"], requires_grad=False)
        self.dt_bias = nn.Parameter(w["dt_proj.bias"], requires_grad=False)
        self.A_log = nn.Parameter(w["A_log"], requires_grad=False)
        self.D = nn.Parameter(w["D"], requires_grad=False)
        self.out_proj = nn.Parameter(w["out_proj.weight"], requires_grad=False)

    def forward(self, x: torch.Tensor, pool: RecurrentPool, plan: ScanPlan, scan) -> torch.Tensor:
        """Shapes: ``x [T, d_model]`` -> ``[T, d_model]``. Reads and writes the pool's state."""
        c, layer = self.config, self.state_layer
        xs, z = F.linear(x, self.in_proj).chunk(2, dim=-1)  # [T, Di] each
        parent_window = pool.parent_states("conv", layer, plan).to(xs.dtype)  # [T, Di, W - 1]
        conv, windows = torch_recurrent.conv_tree(xs, plan.parent_row, parent_window, self.conv_weight, self.conv_bias)
        pool.store("conv", layer, plan, windows)
        xc = F.silu(conv)  # [T, Di]
        dt_raw, B, C = F.linear(xc, self.x_proj).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
        dt = F.softplus(F.linear(dt_raw, self.dt_proj, self.dt_bias))  # [T, Di]
        A = -torch.exp(self.A_log.float())  # [Di, Ns]
        committed, row_states = pool.row_buffer("ssm", layer, plan)
        y = scan(
            xc,
            dt,
            A,
            B,
            C,
            self.D,
            plan.row_order,
            plan.seg_starts,
            plan.parent_src,
            committed,
            plan.request_slots,
            row_states,
            plan.store_index,
            plan.final_slot,
        )
        if not plan.speculative:
            pool.keep_snapshots("ssm", layer, plan, row_states)
        return F.linear(y.to(x.dtype) * F.silu(z), self.out_proj)
