"""`backends.cuda.pdl`: programmatic dependent launch is asked for only where it runs, every kernel that can be
launched with it waits for the kernel ahead before anything else, and a bad ``SPECCYCLE_PDL`` is refused.

The kernels' results with PDL on are checked on a GPU (``tests/kernels`` on an H100) and end to end by the lossless
benchmark; here, on CPU, the rule that makes it safe.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from speccycle.backends.cuda import pdl  # noqa: E402

ROOT = Path(pdl.__file__).resolve().parents[2]  # the package root


def _pdl_kernels() -> list[tuple[str, ast.FunctionDef]]:
    """Every ``@triton.jit`` function of the package with a ``PDL`` parameter (but `pdl_start` itself)."""
    found = []
    for path in sorted([*ROOT.glob("engine/*.py"), *ROOT.glob("backends/*/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name != "pdl_start":
                names = [a.arg for a in node.args.args]
                jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
                if jit and "PDL" in names:
                    found.append((f"{path.relative_to(ROOT)}:{node.name}", node))
    return found


def test_every_pdl_kernel_waits_first():
    """A PDL-launched kernel may run before the kernel ahead has finished: its first statement (after the docstring)
    must be ``pdl_start(PDL)``, and ``PDL`` must default to off (launches elsewhere pass nothing)."""
    kernels = _pdl_kernels()
    names = {name.split(":")[1] for name, _ in kernels}
    assert {"_rope_write_kv_kernel", "_silu_mul_kernel", "_paged_attention_tile_kernel", "_paged_attention_kernel",
            "_paged_attention_combine_kernel", "_int8_linear_kernel", "_argmax_chunk_kernel"} <= names  # fmt: skip
    for name, node in kernels:
        first = node.body[0]
        docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        body = node.body[1:] if docstring else node.body
        assert ast.unparse(body[0]) == "pdl_start(PDL)", f"{name} does not begin with pdl_start(PDL)"
        default = node.args.defaults[-1] if node.args.args[-1].arg == "PDL" else None
        assert default is not None and ast.unparse(default) == "0", f"{name}: PDL must be last, default 0 (off)"


def test_pdl_options_only_where_it_runs(monkeypatch):
    monkeypatch.delenv("SPECCYCLE_PDL", raising=False)
    assert pdl.pdl_options(torch.zeros(1)) == {"PDL": 0}  # CPU tensors: the interpreter
    if torch.cuda.is_available() and pdl.gdc_wait is not None:
        on = torch.cuda.get_device_capability() >= (9, 0) and torch.version.hip is None
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        want = {"PDL": 2, "launch_pdl": True} if on else {"PDL": 0}
        assert pdl.pdl_options(torch.zeros(1, device="cuda")) == want
        monkeypatch.setenv("SPECCYCLE_PDL", "wait")
        assert pdl.pdl_options(torch.zeros(1, device="cuda")) == ({"PDL": 1, "launch_pdl": True} if on else {"PDL": 0})
        monkeypatch.setenv("SPECCYCLE_PDL", "0")
        assert pdl.pdl_options(torch.zeros(1, device="cuda")) == {"PDL": 0}


def test_a_bad_setting_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("SPECCYCLE_PDL", "yes")
    with pytest.raises(ValueError, match=r"SPECCYCLE_PDL='yes': choose 1 .* wait .* or 0"):
        pdl.pdl_options(torch.zeros(1))
    monkeypatch.setenv("SPECCYCLE_PDL", "0")
    assert not pdl.pdl_wanted()
