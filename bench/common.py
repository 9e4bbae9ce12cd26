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
