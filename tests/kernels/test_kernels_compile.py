"""Every cycle kernel compiles for NVIDIA Hopper (sm_90) and AMD MI300 (gfx942), no GPU needed.

The other kernel tests run the kernels in Triton's interpreter, which never invokes the compiler; this
runs `speccycle.engine.kernels.compile_check` in a subprocess without ``TRITON_INTERPRET`` so the
compilers inside the triton wheel (ptxas, the AMD backend) see each kernel at a GPU's block sizes.
The fast engine path's kernels (paged attention, fused ops) are compiled for sm_90 at real models'
constexprs and the JIT's argument specializations (a Triton 3.6 layout-pass crash hid there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def test_kernels_compile_for_hopper_and_mi300():
    from triton.backends import backends

    targets = [name for name, key in (("cuda", "nvidia"), ("hip", "amd")) if key in backends]
    if not targets:
        pytest.skip("this triton ships neither the NVIDIA nor the AMD backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "speccycle.engine.kernels.compile_check", *targets],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failures" in done.stdout
