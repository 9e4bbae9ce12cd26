"""Registers and spills of the fast path's Triton kernels on Hopper, measured without a GPU.

The tile attention kernel is latency-bound and its residency (programs a multiprocessor holds) is set by its
registers a thread, so register pressure decides its speed (before fff0a2d its preamble's int64 key counts held
~45 registers; in int32, 32 tree-verify rows went from 26.0 to 17.8 µs on an H100, figures below). This
compiles kernels for ``sm_90`` with the Triton on this machine, at the constexpr sets of
`engine.kernels.compile_check` (real models' shapes), under each register cap of ``--maxnreg``, and reads
``ptxas -v`` (Triton's own ptxas and flags): registers a thread, spill stores and loads, stack frame. The GPU
machine's Triton may allocate differently (3.6 there: the tile kernel took ~231 registers where this machine's
3.9 takes 210): compare variants with each other, on one Triton.

    python -m speccycle.bench.kernel_registers --kernels _paged_attention_tile_kernel --maxnreg 0,128,96 \
        [--where HEAD_DIM=128,BLOCK_M=32] [--num-stages 1] [--out DIR]

Measured so (Triton 3.9, num_stages 1 as the engine launches it), the tile kernel at the Llama-3-8B shape, a
32-node verify's tiles (BLOCK_M 32, bfloat16): 210 registers uncapped and 296 / 516 bytes of spill stores / loads
at the 128 cap with the int64 preamble, 165 and 56 / 60 with the int32 one; a one-row decode tile 154 -> 138
uncapped, and at the cap 84 / 136 bytes of spills -> none (116 registers)
(bench/results/kernel_registers-tiles-{int64,int32}-*.json).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from .common import write_result

_MISSING = object()
PTXAS_LINE = re.compile(r"Used (\d+) registers")
# constexprs printed beside each row (the JSON has them all)
SHOWN = ("HEAD_DIM", "BLOCK_M", "rows_per_tile", "page_size", "LOW_PRECISION", "NUM_HEADS")
SPILL_LINE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """``{"registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes"}`` from a ``ptxas -v`` log of one
    kernel (the first function's figures)."""
    used, spill = PTXAS_LINE.search(log), SPILL_LINE.search(log)
    if used is None or spill is None:
        raise ValueError(f"no register report in the ptxas log: {log[-500:]!r}")
    stack, stores, loads = (int(x) for x in spill.groups())
    return {"registers": int(used.group(1)), "stack_bytes": stack, "spill_store_bytes": stores,
            "spill_load_bytes": loads}  # fmt: skip


def ptxas_report(ptx: str) -> dict:
    """Assemble ``ptx`` for sm_90a with Triton's own ptxas and options; the register report of `parse_ptxas`."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o", src + ".o"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return parse_ptxas(done.stderr + done.stdout)


def measure(names: list[str] | None, caps: list[int], num_warps: int = 4, num_stages: int | None = None,
            where: dict | None = None) -> list[dict]:  # fmt: skip
    """One row per (kernel of `compile_check.engine_specs` named in ``names``, constexpr set holding every item
    of ``where``, register cap; 0 or None: no cap)."""
    from ..backends.cuda.compile_specs import TARGETS, compile_kernel, require_compiled
    from ..engine.kernels import compile_check

    os.environ.pop("TRITON_INTERPRET", None)  # the JIT must compile, not interpret
    rows = []
    for kernel, signature, sets, aligned in compile_check.engine_specs():
        name = kernel.__name__
        if names and name not in names:
            continue
        require_compiled(kernel)
        for constexprs in sets:
            if where and any(constexprs.get(k, _MISSING) != v for k, v in where.items()):
                continue
            for cap in caps:
                launch = {"num_warps": num_warps}
                if num_stages is not None:
                    launch["num_stages"] = num_stages
                if cap:
                    launch["maxnreg"] = cap
                compiled = compile_kernel(kernel, signature, constexprs, aligned, TARGETS["cuda"], **launch)
                shown = {k: v for k, v in constexprs.items() if isinstance(v, (bool, int, float, str))}
                rows.append({"kernel": name, "constexprs": shown, "maxnreg": cap or None, **launch,
                             **ptxas_report(compiled.asm["ptx"])})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="_paged_attention_tile_kernel",
                        help="comma-separated kernel names of compile_check's fast-path list ('' for all)")  # fmt: skip
    parser.add_argument("--maxnreg", default="0,128", help="register caps to compile under (0: none)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=1, help="1: the engine's launch of the attention kernels")
    parser.add_argument("--where", default="", help="only constexpr sets with these values: HEAD_DIM=128,BLOCK_M=32")
    parser.add_argument("--out", default=None, help="directory for the JSON (default: bench/results)")
    args = parser.parse_args()
    names = [n for n in args.kernels.split(",") if n] or None
    where = {}
    for item in filter(None, args.where.split(",")):
        key, _, value = item.partition("=")
        where[key] = {"True": True, "False": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    rows = measure(names, [int(c) for c in args.maxnreg.split(",")], args.num_warps, args.num_stages, where)
    for row in rows:
        sets = " ".join(f"{k}={v}" for k, v in row["constexprs"].items() if k in SHOWN)
        print(f"{row['kernel']:32s} {sets:60s} cap {str(row['maxnreg']):4s} registers {row['registers']:3d} "
              f"spills {row['spill_store_bytes']:4d} / {row['spill_load_bytes']:4d} B", flush=True)  # fmt: skip
    import triton

    target = "sm_90a (ptxas -v; compiled on this machine, no GPU)"
    payload = {"target": target, "triton": triton.__version__, "rows": rows}
    print("wrote", write_result("kernel_registers", payload, directory=args.out))


if __name__ == "__main__":
    main()
