"""`bench.scale_profile.cycle_breakdown`: a fused cycle's GPU time cut into its phases at the kernels every cycle
runs once, on a synthetic kernel timeline (the GPU run's timelines are in bench/results/scale_profile-*)."""

from __future__ import annotations

from bench.scale_profile import cycle_breakdown, kernel_kind, timeline


def cycles(n: int) -> list[tuple[float, float, str]]:
    """``n`` cycles of 100 µs: accept+extend 20 µs (a GEMM of 10), draft levels 30 (attention 5, a GEMM of 20),
    verify 50 (a GEMM of 40, a torch op of 2); each phase's kernels back to back from its start."""
    phases = ((0, (("_accept_commit_kernel", 4), ("nvjet_tst_64x8", 10))),
              (20, (("_cycle_slots_kernel", 4), ("_paged_attention_tile_kernel", 5), ("nvjet_tst_128x8", 20))),
              (50, (("_verify_rows_kernel", 2), ("nvjet_tst_512x32", 40), ("void at::native::argmax", 2))))  # fmt: skip
    events = []
    for c in range(n):
        for offset, kernels in phases:
            t = 100.0 * c + offset
            for name, dur in kernels:
                events.append((t, t + dur, name))
                t += dur
    return events


def test_a_cycle_is_cut_into_its_phases_and_kinds():
    got = cycle_breakdown(cycles(6))
    assert got["cycles"] == 3  # the first and the last two cut off: partial or warm-up
    assert got["cycle"] == {"wall_us": 100.0, "kernels": 8}
    assert got["accept+extend"]["wall_us"] == 20.0 and got["accept+extend"]["gemm"] == 10.0
    assert got["draft levels"] == {"wall_us": 30.0, "kernels": 3, "triton": 4.0, "attention": 5.0, "gemm": 20.0}
    assert got["verify"]["wall_us"] == 50.0 and got["verify"]["gemm"] == 40.0 and got["verify"]["torch"] == 2.0


def test_too_short_a_profile_has_no_cycle_and_the_timeline_keeps_gaps():
    assert cycle_breakdown(cycles(2)) == {}
    lines = timeline([(10.0, 12.0, "a"), (15.0, 16.5, "b")])
    assert [line.split()[:3] for line in lines] == [["0.0", "0.0", "2.0"], ["5.0", "3.0", "1.5"]]
    assert [kernel_kind(n) for n in ("nvjet_x", "_paged_attention_combine_kernel", "void at::x", "_topk")] == [
        "gemm", "attention", "torch", "triton"]  # fmt: skip


def test_write_result_records_the_speccycle_settings(tmp_path, monkeypatch):
    """A result names the kernel and library settings it ran under (SPECCYCLE_BLAS, ...), and the commit only once."""
    import json
    import os

    from bench.common import write_result

    monkeypatch.setenv("SPECCYCLE_BLAS", "cublaslt")
    monkeypatch.setenv("SPECCYCLE_COMMIT", "abc1234")
    record = json.loads(write_result("probe", {"x": 1}, directory=tmp_path).read_text())
    assert record["commit"] == "abc1234" and record["x"] == 1
    assert record["settings"]["SPECCYCLE_BLAS"] == "cublaslt" and "SPECCYCLE_COMMIT" not in record["settings"]
    for key in [k for k in os.environ if k.startswith("SPECCYCLE_") and k != "SPECCYCLE_COMMIT"]:
        monkeypatch.delenv(key)
    assert "settings" not in json.loads(write_result("probe", {}, directory=tmp_path / "b").read_text())


def test_kernel_specializations_counts_what_triton_announces_and_restores_its_hook():
    """`bench.common.KernelSpecializations` counts each new specialization by kernel name from Triton's cache hook
    (called as Triton calls it: keywords only; the name from ``fn``, else from ``repr``), records its signature,
    constants and specializations, passes the call on to a hook installed before it, and puts that hook back on
    exit, an exception's too."""
    from types import SimpleNamespace

    import pytest

    knobs = pytest.importorskip("triton").knobs
    from bench.common import KernelSpecializations

    before, seen = knobs.runtime.jit_cache_hook, []

    def recorder(**kwargs):
        seen.append(kwargs["repr"])

    compiled = {"signature": {"bs": "i32"}, "constants": {(1,): 128}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    knobs.runtime.jit_cache_hook = recorder
    try:
        with KernelSpecializations() as counted:
            for name, fn in (("_fill_bonus_kernel", SimpleNamespace(name="_fill_bonus_kernel")),
                             ("_slots_kernel", None), ("_fill_bonus_kernel", None)):  # fmt: skip
                call = dict(key=None, fn=fn, compile=compiled, is_manual_warmup=False, already_compiled=False)
                assert not knobs.runtime.jit_cache_hook(repr=f"{name}[num_warps=4](bs: ()", **call)
        assert knobs.runtime.jit_cache_hook is recorder and len(seen) == 3
        assert counted.counts == {"_fill_bonus_kernel": 2, "_slots_kernel": 1}
        detail = "signature {'bs': 'i32'} constants {(1,): 128} attrs {(0,): [['tt.divisibility', 16]]}"
        names = ("_fill_bonus_kernel", "_slots_kernel", "_fill_bonus_kernel")
        assert counted.variants == [f"{n} {detail}" for n in names]
        with pytest.raises(RuntimeError), KernelSpecializations() as failed:
            raise RuntimeError("a step failed")
        assert knobs.runtime.jit_cache_hook is recorder and failed.counts == {}
    finally:
        knobs.runtime.jit_cache_hook = before
