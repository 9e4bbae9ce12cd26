"""The cycle's bookkeeping kernels compile once whatever the batch: no Triton compile in the middle of serving.

Triton compiles a kernel once per set of constexpr values and per specialization of its other arguments (an int
equal to 1 or divisible by 16, a pointer's 16-byte alignment). A value that follows the batch (its size, its entry
count, a row width that depends on what the requests ask for) therefore compiles a new kernel the first time a
batch brings it, inside that step's time: a soak on an H200 met three such compiles in a run (docs: serving, "Load
test and soak"). Here each wrapper is launched at many batch shapes and must pick the same constexprs every time
(as it does where it compiles: the interpreter's own block choices are set aside), and the arguments that follow
the batch must be marked not to specialize. The outputs are checked against the torch reference at each shape.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.backends.torch import TorchBackend

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.backends.cuda import accept, kv, sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ref = TorchBackend()


class Launches:
    """Stands in for a ``@triton.jit`` kernel in its module: records each launch's constexprs, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.constexprs = kernel, set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.constexprs.add(tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper())))
            return launch(*args, **kwargs)

        return run


def _unspecialized(kernel) -> set[str]:
    """The arguments ``kernel`` was declared not to specialize (a compiled kernel's, or the interpreter's record)."""
    names = [p.name for p in kernel.params] if hasattr(kernel, "params") else list(kernel.arg_names)
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:  # the interpreter keeps the decorator's arguments as given
        declared = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return {names[i] if isinstance(i, int) else i for i in declared}


def test_fill_bonus_and_gather_accepted_take_one_variant_per_row_kind(monkeypatch):
    bonus, gather = Launches(accept._fill_bonus_kernel), Launches(accept._gather_accepted_kernel)
    monkeypatch.setattr(accept, "_fill_bonus_kernel", bonus)
    monkeypatch.setattr(accept, "_gather_accepted_kernel", gather)
    widths = {"narrow": (1, 3, 20, 32), "wide": (33, 576)}
    seen = {}
    for bs in (1, 3, 16, 64, 130):
        width = 5
        tokens = torch.randint(0, 100, (bs, width), device=DEVICE)
        lengths = torch.randint(1, width + 1, (bs,), device=DEVICE)
        assert torch.equal(accept.fill_bonus(tokens, lengths, width), ref.fill_bonus(tokens, lengths, width))
        rows_of = torch.randint(0, bs * width, (bs, width), device=DEVICE)
        index = torch.where(torch.rand(bs, width, device=DEVICE) < 0.7, rows_of, -1)
        for kind, features in widths.items():
            for f in features:
                rows = torch.randn(bs * width, f, device=DEVICE)
                gather.constexprs.clear()
                assert torch.equal(accept.gather_accepted(rows, index), ref.gather_accepted(rows, index))
                seen.setdefault(kind, set()).update(gather.constexprs)
    assert len(bonus.constexprs) == 1
    assert len(seen["narrow"]) == 1 and len(seen["wide"]) == 1
    assert _unspecialized(bonus.kernel) >= {"bs", "stride"}
    assert _unspecialized(gather.kernel) >= {"num_entries", "features"}


def test_slots_for_positions_takes_one_variant_where_it_compiles(monkeypatch):
    slots = Launches(kv._slots_kernel)
    monkeypatch.setattr(kv, "_slots_kernel", slots)
    monkeypatch.setattr(kv, "interpreted", lambda: False)  # the compiled launch's blocks, run by the interpreter
    page_size = 4
    for bs, width in ((1, 1), (3, 5), (16, 1), (64, 5), (2, 200), (130, 3)):
        table = torch.arange(bs * 64, device=DEVICE).view(bs, 64)
        positions = torch.randint(0, 64 * page_size, (bs, width), device=DEVICE)
        got = kv.slots_for_positions(table, positions, page_size)
        assert torch.equal(got, ref.slots_for_positions(table, positions, page_size))
    assert slots.constexprs == {(("BLOCK", kv.SLOTS_BLOCK), ("BLOCK_R", kv.SLOTS_BLOCK_R))}
    assert _unspecialized(slots.kernel) >= {"bs", "width", "table_stride", "max_pages"}


def test_the_sampling_verifies_do_not_specialize_what_a_batch_changes():
    assert _unspecialized(sampling._chain_kernel) >= {"num_steps"}
    assert _unspecialized(sampling._tree_kernel) >= {"n", "width"}
    assert _unspecialized(sampling._keyed_uniforms_kernel) >= {"count"}
