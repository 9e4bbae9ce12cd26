"""`bench/kernel_registers.py`: ptxas's register report parsed, and a register cap reaching the compiled kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from speccycle.bench.kernel_registers import measure, parse_ptxas

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_paged_attention_tile_kernel' for 'sm_90a'
ptxas info    : Function properties for _paged_attention_tile_kernel
    56 bytes stack frame, 56 bytes spill stores, 60 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 56 bytes cumulative stack size
"""


def test_parse_ptxas_reads_registers_and_spills():
    assert parse_ptxas(LOG) == {"registers": 128, "stack_bytes": 56, "spill_store_bytes": 56, "spill_load_bytes": 60}
    with pytest.raises(ValueError, match="no register report"):
        parse_ptxas("ptxas fatal   : Unsupported .version")


def test_a_register_cap_reaches_the_tile_kernel_without_a_gpu(tmp_path):
    """One tile-kernel specialization of compile_check (Llama-3-8B heads, a 32-node verify's extra columns,
    bfloat16, one-row tiles), compiled for sm_90 on this machine uncapped and at 96 registers, in a process
    without TRITON_INTERPRET (the suite's kernels are interpreted)."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton ships no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "speccycle.bench.kernel_registers", "--kernels", "_paged_attention_tile_kernel",
         "--where", "HEAD_DIM=128,BLOCK_M=32,LOW_PRECISION=True,rows_per_tile=1", "--maxnreg", "0,96",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = tmp_path.glob("kernel_registers-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["maxnreg"] for r in rows] == [None, 96]
    uncapped, capped = rows
    assert all(r["constexprs"]["rows_per_tile"] == 1 and r["num_stages"] == 1 for r in rows)
    assert 96 < uncapped["registers"] <= 255
    assert capped["registers"] <= 96 and capped["spill_store_bytes"] > uncapped["spill_store_bytes"]


def test_measure_refuses_interpreted_kernels(monkeypatch):
    """Under TRITON_INTERPRET=1 (the suite) the kernels are the interpreter's: a clear error, not a crash."""
    import speccycle.engine.kernels.attention_tiles as tiles

    if type(tiles._paged_attention_tile_kernel).__name__ != "InterpretedFunction":
        pytest.skip("the kernels were imported compiled (TRITON_INTERPRET unset)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="fresh process"):
        measure(["_paged_attention_tile_kernel"], [0])
