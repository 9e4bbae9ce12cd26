"""Shared pieces of the benchmarks: where results go and what every result records."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: str) -> None:
    """Wait for the device's queued work (a CUDA device; nothing elsewhere), so a wall clock times it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def commit() -> str:
    """The measured commit (`engine.bench.git_commit`: ``$SPECCYCLE_COMMIT`` where set, else the checkout's)."""
    from speccycle.engine.bench import git_commit

    return git_commit()


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_ms(ttft, tpot) -> dict:
    """p50 and p99 in milliseconds of times to first token and times per output token (seconds in)."""

    def ms(value):
        return None if value is None else round(value * 1000, 3)

    return {
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99)), "count": len(ttft)},
        "tpot_ms": {"p50": ms(percentile(tpot, 50)), "p99": ms(percentile(tpot, 99)), "count": len(tpot)},
    }


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


class KernelSpecializations:
    """Counts the Triton kernel specializations a block of code meets for the first time in this process (each one
    compiles, or at least loads from Triton's disk cache, before its launch), by kernel name.

    A serving run should meet none: each costs a compile (tenths of a second to seconds) inside some request's
    time. Triton calls ``knobs.runtime.jit_cache_hook`` for every new specialization; where it has no such hook
    (an older Triton, or none installed) ``counts`` stays None. The interpreter (``TRITON_INTERPRET=1``) compiles
    nothing, so it counts nothing::

        with KernelSpecializations() as seen:
            run()
        seen.counts  # {"_fill_bonus_kernel": 1, ...}, or None where it cannot tell
        seen.variants  # each one's kernel, signature (argument types), constants and argument specializations
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] | None = None
        self.variants: list[str] = []
        self._runtime = self._before = None

    def _hook(self, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        compiled = kwargs.get("compile") or {}
        attrs = (compiled.get("configs") or [{}])[0]  # argument index -> its specialization (16-divisible, ...)
        self.variants.append(
            f"{name} signature {compiled.get('signature')} constants {compiled.get('constants')} attrs {attrs}"
        )
        return self._before(**kwargs) if self._before is not None else None  # a truthy answer would skip the compile

    def __enter__(self) -> KernelSpecializations:
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return self
        self.counts, self._runtime, self._before = {}, runtime, runtime.jit_cache_hook
        runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._before
            self._runtime = None


def result_record(name: str, payload: dict, device: str = "cpu", now: _dt.datetime | None = None) -> dict:
    """A benchmark record: ``payload`` under the benchmark's name, device, date, commit, torch, and the ``SPECCYCLE_*``
    settings of the environment (the attention kernel, the BLAS library, ...) where any is set."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    record = {
        "benchmark": name,
        "device": device_name(device),
        "date": now.isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        **payload,
    }
    settings = {  # a path (the model file) by its name: where a machine keeps it says nothing of the figures
        k: Path(v).name if os.sep in v else v
        for k, v in sorted(os.environ.items())
        if k.startswith("SPECCYCLE_") and k != "SPECCYCLE_COMMIT"
    }
    if settings:
        record.setdefault("settings", settings)
    return record


def write_result(name: str, payload: dict, device: str = "cpu", directory: str | Path | None = None) -> Path:
    """Write ``<directory>/<name>-<date>.json`` (default ``bench/results``): `result_record`'s record."""
    directory = Path(directory) if directory is not None else RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    path = directory / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result_record(name, payload, device, now), indent=2) + "\n")
    return path


def transformers_model(dtype: torch.dtype, device: str):
    """transformers' model of the embedded GGUF: its weights exported as a Hugging Face directory
    (`weights_hf.save_hf`) and loaded from there, so transformers needs neither its GGUF reader nor
    accelerate. Returns the model in eval mode on ``device``."""
    import tempfile

    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf
    from speccycle.engine.weights.weights_hf import save_hf
    from transformers import AutoModelForCausalLM

    config, weights = load_gguf(default_model_path(), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as directory:
        save_hf(directory, config, weights)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=dtype)
    return model.to(device).eval()
