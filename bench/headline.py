"""The headline figures: declared once here, read from their result files, written into README.md and docs.

Each `Headline` names one result file under `bench/results/`, the values it shows (a key path into the JSON
and a format) and two templates, what was measured and the figure, that place those values. Nothing in the
README's results table or in the results index page is typed by hand: both are rendered from this list, and
`tests/docs/test_headline.py` fails when the committed files differ from what the JSON gives.

    python -m bench.headline            # rewrite README.md's and the EAGLE head's results blocks, and
                                        # docs/results_index.md
    python -m bench.headline --check    # exit 1, naming the files, when one is stale

`HEADLINES` are the README's table, `MODEL_CARD` the evaluation table of the shipped EAGLE head's model card
(`engine/data/eagle/README.md`); each sits between `<!-- speccycle:results -->` and `<!-- /speccycle:results -->`
in its file. A key path is
a tuple: a string picks a key of an object, an int an item of a list, a dict the one item of a list whose
fields equal it (none or several is an error), and `"*"` every item of a list, which the value's `reduce`
(`min`, `max`, `len`, `sum`) turns into one number. The device, date and commit of a row are the file's own
(`device`, `date`, `commit`; a file without a date gives the `YYYYMMDD` of its name).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "bench/results"
README = "README.md"
CARD = "engine/data/eagle/README.md"
INDEX = "docs/results_index.md"
BEGIN, END = "<!-- speccycle:results -->", "<!-- /speccycle:results -->"
MAX_ROWS = 10

Step = str | int | dict


@dataclass(frozen=True)
class Value:
    """One number of a result file: where it is (`path`), how it is written (`fmt`, a format spec)."""

    path: tuple[Step, ...]
    fmt: str = ""
    reduce: str | None = None  # min, max, len or sum over the items a "*" step gives
    over: tuple[Step, ...] | None = None  # a ratio: the number at `path` over the one at `over`, then formatted


@dataclass(frozen=True)
class Headline:
    """One row of the README's results table: `what` and `figure` are templates over `values`."""

    what: str
    figure: str
    file: str  # under bench/results/
    values: dict[str, Value] = field(default_factory=dict)


_FAST_AR = {"system": "engine autoregressive, fast path"}
_ONE_ROW_AR = {"system": "engine autoregressive, fast path, 1 row per step"}
_S6K4N24 = {"system": "engine speculative eagle:S6K4N24"}
_S7K6N32 = {"system": "engine speculative eagle:S7K6N32"}
_FUSED = "fused cycles (engine.fused_cycle)"
_CHAIN = {"system": "speculative EAGLE-3-shaped head, chain of 4", "control_plane": _FUSED}
_TREE = {"system": "speculative EAGLE-3-shaped head, 32-node tree", "control_plane": _FUSED}


def _over_ar(batch_size: int, mode: str) -> Value:
    """A mode's tokens/s over `ar`'s at one load of a `bench.scheduler_throughput` record."""
    row = ("rows", {"batch_size": batch_size})
    return Value((*row, mode, "tokens_per_s"), ".2f", over=(*row, "ar", "tokens_per_s"))


def _bench_values() -> dict[str, Value]:
    """The values a `speccycle bench --json` record gives."""
    return {
        "prompts": Value(("prompts",), "d"),
        "tokens": Value(("max_new_tokens",), "d"),
        "S": Value(("config", "S"), "d"),
        "K": Value(("config", "K"), "d"),
        "N": Value(("config", "N"), "d"),
        "ar": Value(("ar_tokens_per_s",), ",.1f"),
        "spec": Value(("spec_tokens_per_s",), ",.1f"),
        "speedup": Value(("speedup",), ".3f"),
        "identical": Value(("identical_to_ar",), "d"),
        "dtype": Value(("config", "dtype")),
    }


HEADLINES: tuple[Headline, ...] = (
    Headline(
        what="`speccycle bench`, SmolLM2-135M in {dtype} with the shipped EAGLE-3 head (S{S} K{K} N{N}), "
        "all {prompts} Spec-Bench dev prompts x {tokens} tokens",
        figure="speculative {spec} / autoregressive {ar} tokens/s: **{speedup}x** (tau {tau}); "
        "{identical}/{prompts} identical",
        file="speccycle_bench-H200-20261127-13e0beb-240dev-128tok.json",
        values={**_bench_values(), "tau": Value(("tau",), ".3f")},
    ),
    Headline(
        what="`speccycle bench` with its defaults: the {prompts} prompts it ships x {tokens} tokens",
        figure="**{speedup}x** ({spec} / {ar} tokens/s, tau {tau}); {identical}/{prompts} identical",
        file="speccycle_bench-H200-20261127-13e0beb-default.json",
        values={**_bench_values(), "tau": Value(("tau",), ".3f")},
    ),
    Headline(
        what="the continuous-batching scheduler (CUDA graphs, admission under the cycle, pipelined cycles, the prefill "
        "attention kernel, admissions batched while speculating, verify attention at one pipelining stage, the "
        "decode's attention launch and merge, adaptive shapes compared by their replays' device time, every prefill "
        "graph captured before serving), SmolLM2-135M bf16 with the shipped EAGLE-3 head (chain S4), "
        "closed loop, {tokens} tokens a request, the median of three runs a mode",
        figure="speculative over autoregressive **{r1}x** at 1 client ({spec1} / {ar1} tokens/s), {r4}x at 4, "
        "{r16}x at 16, {r64}x at 64, {r256}x at 256; adaptive speculation {a1}x, {a4}x, {a16}x, {a64}x, {a256}x; "
        "{identical} requests identical",
        file="scheduler_throughput-H200-20261128-58a6056-chain-S4-repeats3.json",
        values={
            "tokens": Value(("max_new_tokens",), "d"),
            **{f"r{n}": _over_ar(n, "spec") for n in (1, 4, 16, 64, 256)},
            **{f"a{n}": _over_ar(n, "adaptive") for n in (1, 4, 16, 64, 256)},
            "spec1": Value(("rows", {"batch_size": 1}, "spec", "tokens_per_s"), ",.1f"),
            "ar1": Value(("rows", {"batch_size": 1}, "ar", "tokens_per_s"), ",.1f"),
            "identical": Value(("rows", "*", "adaptive", "identical_to_ar"), ",d", reduce="sum"),
        },
    ),
    Headline(
        what="SmolLM2-135M bf16, batch 1, {prompts} prompts x {tokens} tokens: autoregressive on the fast path "
        "(Triton attention, CUDA graphs) against transformers",
        figure="fast path **{fast}** tokens/s (1-row decode {one_row}) / transformers `generate` {hf}, "
        "its prompt lookup {hf_lookup}",
        file="gpu_bench-H100-real-hf-20261126-004531-bb58ed3.json",
        values={
            "prompts": Value(("hf", "rows", {"system": "transformers generate"}, "prompts"), "d"),
            "tokens": Value(("real", "max_new_tokens"), "d"),
            "fast": Value(("real", "rows", _FAST_AR, "tokens_per_s"), ",.1f"),
            "one_row": Value(("real", "rows", _ONE_ROW_AR, "tokens_per_s"), ",.1f"),
            "hf": Value(("hf", "rows", {"system": "transformers generate"}, "tokens_per_s"), ",.1f"),
            "hf_lookup": Value(("hf", "rows", {"system": "transformers prompt lookup"}, "tokens_per_s"), ",.1f"),
        },
    ),
    Headline(
        what="speculative on the fast path, SmolLM2-135M bf16, batch 1, {prompts} prompts x {tokens} tokens, "
        "the shipped EAGLE-3 head (trained at 1a9d791)",
        figure="tree S6 K4 N24 {tree} tokens/s, **{speedup}x** over the fast path's {fast} (tau {tau}), "
        "{identical}/{prompts} identical; S7 K6 N32 {speedup32}x, {identical32}/{prompts} identical",
        file="gpu_bench-H100-real-head-1a9d791-round2-20261126-061042.json",
        values={
            "prompts": Value(("real", "rows", _S6K4N24, "prompts"), "d"),
            "tokens": Value(("real", "max_new_tokens"), "d"),
            "tree": Value(("real", "rows", _S6K4N24, "tokens_per_s"), ",.1f"),
            "speedup": Value(("real", "rows", _S6K4N24, "speedup_vs_fast_ar"), ".3f"),
            "fast": Value(("real", "rows", _FAST_AR, "tokens_per_s"), ",.1f"),
            "tau": Value(("real", "rows", _S6K4N24, "tau"), ".3f"),
            "speedup32": Value(("real", "rows", _S7K6N32, "speedup_vs_fast_ar"), ".3f"),
            "identical": Value(("real", "rows", _S6K4N24, "identical_to_ar"), "d"),
            "identical32": Value(("real", "rows", _S7K6N32, "identical_to_ar"), "d"),
        },
    ),
    Headline(
        what="greedy losslessness, float32, all {prompts} Spec-Bench dev prompts x {tokens} tokens: "
        "{configs} configs (ngram, layerskip, EAGLE; chains and trees; P 1 and 16)",
        figure="identical to autoregressive: **{identical}/{prompts}** in the config with the fewest",
        file="lossless_sweep-H100-float32-128tok-20261122.json",
        values={
            "prompts": Value(("prompts",), "d"),
            "tokens": Value(("new_tokens",), "d"),
            "configs": Value(("configs", "*"), "d", reduce="len"),
            "identical": Value(("configs", "*", "identical_to_ar"), "d", reduce="min"),
        },
    ),
    Headline(
        what="losslessness in bf16 on the fast path (fused cycles), {prompts} prompts x {tokens} tokens, "
        "the shipped head",
        figure="S6 K4 N24 **{s6}/{prompts}** and S7 K6 N32 **{s7}/{prompts}** identical to autoregressive",
        file="gpu_bench-H100-lossless-1a9d791-round2-20261126-061439.json",
        values={
            "prompts": Value(("lossless", "rows", 0, "prompts"), "d"),
            "tokens": Value(("lossless", "max_new_tokens"), "d"),
            "s6": Value(("lossless", "rows", {"config": "eagle:S6K4N24"}, "identical_to_ar"), "d"),
            "s7": Value(("lossless", "rows", {"config": "eagle:S7K6N32"}, "identical_to_ar"), "d"),
        },
    ),
    Headline(
        what="CPU, float32, batch 1, all {prompts} prompts x {tokens} tokens: the engine against transformers, "
        "and prompt lookup (ngram)",
        figure="engine **{engine}** / transformers {hf} tokens/s (**{ratio}x**), {equal}/{prompts} equal; "
        "ngram **{ngram}x** (tau {tau}), {identical}/{prompts} identical",
        file="cpu_compare-240-20261125-114520.json",
        values={
            "prompts": Value(("prompts",), "d"),
            "tokens": Value(("new_tokens",), "d"),
            "engine": Value(("transformers", "all", "engine_ar_tokens_per_s"), ".2f"),
            "hf": Value(("transformers", "all", "generate_tokens_per_s"), ".2f"),
            "ratio": Value(("transformers", "all", "engine_ar_over_generate"), ".3f"),
            "equal": Value(("transformers", "all", "engine_ar_identical_to_transformers"), "d"),
            "ngram": Value(("drafts", "ngram", "speedup"), ".3f"),
            "tau": Value(("drafts", "ngram", "tau"), ".3f"),
            "identical": Value(("drafts", "ngram", "identical_to_ar"), "d"),
        },
    ),
    Headline(
        what="CPU, float32 target, {prompts} prompts x {tokens} tokens: EAGLE-3 tree S3 K2 N6 (bf16 head)",
        figure="{eagle} tokens/s, **{speedup}x** over autoregressive {ar} (tau {tau}); ngram {ngram}x; "
        "{identical}/{prompts} identical",
        file="cpu_drafters-20261126-062023-0ba6374.json",
        values={
            "prompts": Value(("config", "prompts"), "d"),
            "tokens": Value(("config", "max_new_tokens"), "d"),
            "eagle": Value(("rows", "S3K2N6:bf16", "tokens_per_s"), ".2f"),
            "speedup": Value(("rows", "S3K2N6:bf16", "speedup"), ".3f"),
            "ar": Value(("rows", "ar", "tokens_per_s"), ".2f"),
            "tau": Value(("rows", "S3K2N6:bf16", "tau"), ".3f"),
            "ngram": Value(("rows", "ngram", "speedup"), ".3f"),
            "identical": Value(("rows", "S3K2N6:bf16", "identical_to_ar"), "d"),
        },
    ),
    Headline(
        what="Llama-3-8B shape, bf16, forced tau: the overhead factor (tau over the speedup against the 1-row "
        "decode; 1.0 is a cycle as cheap as a decode step)",
        figure="chain of 4 **{chain}**, 32-node tree **{tree}**; the 1-row decode at {share} of its bandwidth limit",
        file="gpu_bench-H100-scale-1c6eb87-final-s1-20261126-161048.json",
        values={
            "chain": Value(("scale", "runs", _CHAIN, "overhead_factor"), ".3f"),
            "tree": Value(("scale", "runs", _TREE, "overhead_factor"), ".3f"),
            "share": Value(("scale", "runs", {"system": "autoregressive (1 row per step)"}, "share_of_limit"), ".1%"),
        },
    ),
)


def _head_config(S: int, K: int, N: int, key: str) -> Value:
    """A value of one config of the shipped head's `train_draft_eval` record."""
    return Value(("heads", "s18.eagle", "configs", {"S": S, "K": K, "N": N}, key), ".3f")


def _headline(file: str) -> Headline:
    return next(h for h in HEADLINES if h.file == file)


MODEL_CARD: tuple[Headline, ...] = (
    Headline(
        what="tau, {dtype}, greedy, all {prompts} Spec-Bench dev prompts x {tokens} tokens, the int8 file",
        figure="chain S5 **{c5}** (MT-bench {m5}), tree S5 K4 N16 **{t16}** ({m16}), S6 K4 N32 {t32} ({m32}), "
        "S7 K6 N32 **{t7}** ({m7}); the fewest identical to autoregressive {identical}/{prompts}",
        file="train_draft_eval-H100-1a9d791-round2-1-20261126-060934.json",
        values={
            "dtype": Value(("dtype",)),
            "prompts": Value(("prompts",), "d"),
            "tokens": Value(("new_tokens",), "d"),
            "c5": _head_config(5, 1, 6, "tau"),
            "m5": _head_config(5, 1, 6, "tau_mt_bench"),
            "t16": _head_config(5, 4, 16, "tau"),
            "m16": _head_config(5, 4, 16, "tau_mt_bench"),
            "t32": _head_config(6, 4, 32, "tau"),
            "m32": _head_config(6, 4, 32, "tau_mt_bench"),
            "t7": _head_config(7, 6, 32, "tau"),
            "m7": _head_config(7, 6, 32, "tau_mt_bench"),
            "identical": Value(("heads", "s18.eagle", "configs", "*", "identical_to_ar"), "d", reduce="min"),
        },
    ),
    Headline(
        what="tau, other shapes, the same {prompts} prompts x {tokens} tokens",
        figure="chain S3 {c3}, S4 {c4}, S6 {c6}; tree S4 K2 N8 {t8}, S6 K8 N64 {t64}; the fewest identical "
        "{identical}/{prompts}",
        file="train_draft_eval-H100-1a9d791-round2-2-20261126-061326.json",
        values={
            "prompts": Value(("prompts",), "d"),
            "tokens": Value(("new_tokens",), "d"),
            "c3": _head_config(3, 1, 4, "tau"),
            "c4": _head_config(4, 1, 5, "tau"),
            "c6": _head_config(6, 1, 7, "tau"),
            "t8": _head_config(4, 2, 8, "tau"),
            "t64": _head_config(6, 8, 64, "tau"),
            "identical": Value(("heads", "s18.eagle", "configs", "*", "identical_to_ar"), "d", reduce="min"),
        },
    ),
    _headline("gpu_bench-H100-lossless-1a9d791-round2-20261126-061439.json"),
    _headline("gpu_bench-H100-real-head-1a9d791-round2-20261126-061042.json"),
    _headline("speccycle_bench-H200-20261127-13e0beb-240dev-128tok.json"),
    _headline("cpu_drafters-20261126-062023-0ba6374.json"),
)
TABLES: dict[str, tuple[Headline, ...]] = {README: HEADLINES, CARD: MODEL_CARD}


# ---- reading ------------------------------------------------------------------------------------
def _step_label(step: Step) -> str:
    if isinstance(step, dict):
        return "[" + ", ".join(f"{k}={json.dumps(v)}" for k, v in step.items()) + "]"
    if isinstance(step, int) or step == "*":
        return f"[{step}]"
    return f".{step}"


def path_label(value: Value) -> str:
    """`real.rows[system="..."].tokens_per_s`, with the reduction around it: `min(configs[*].identical)`."""
    label = "".join(_step_label(s) for s in value.path).lstrip(".")
    if value.over is not None:
        label += " / " + "".join(_step_label(s) for s in value.over).lstrip(".")
    return f"{value.reduce}({label})" if value.reduce else label


def lookup(data, path: tuple[Step, ...]):
    """The item at ``path`` (a list where a ``"*"`` step maps the rest over a list's items)."""
    if not path:
        return data
    step, rest = path[0], path[1:]
    if step == "*":
        if not isinstance(data, list):
            raise KeyError(f"[*] needs a list, found {type(data).__name__}")
        return [lookup(item, rest) for item in data]
    if isinstance(step, dict):
        if not isinstance(data, list):
            raise KeyError(f"{_step_label(step)} needs a list, found {type(data).__name__}")
        found = [item for item in data if isinstance(item, dict) and all(item.get(k) == v for k, v in step.items())]
        if len(found) != 1:
            raise KeyError(f"{_step_label(step)} matches {len(found)} items, not one")
        return lookup(found[0], rest)
    if isinstance(step, int):
        if not isinstance(data, list) or not -len(data) <= step < len(data):
            raise KeyError(f"[{step}]: no such item")
        return lookup(data[step], rest)
    if not isinstance(data, dict) or step not in data:
        raise KeyError(f"no key {step!r}")
    return lookup(data[step], rest)


def read_value(data: dict, value: Value):
    """The number ``value`` names in ``data``, reduced where its path maps over a list."""
    raw = lookup(data, value.path)
    if value.over is not None:  # a ratio of two figures the file holds, rounded once, where it is shown
        return round(raw / lookup(data, value.over), 6)
    if value.reduce is None:
        if isinstance(raw, list):
            raise KeyError("a [*] path needs a reduce (min, max, len, sum)")
        return raw
    if not isinstance(raw, list) or not raw:
        raise KeyError(f"{value.reduce} needs a non-empty [*] path")
    return {"min": min, "max": max, "len": len, "sum": sum}[value.reduce](raw)


def short_device(device: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100`; `x86_64 (2 threads)` -> `x86_64, 2 threads`."""
    if device.startswith("NVIDIA "):
        return device.split()[1]
    return re.sub(r"\s*\((.*)\)$", r", \1", device)


@dataclass(frozen=True)
class Row:
    """A headline read from its file: the rendered texts, each value, and where and when it was measured."""

    headline: Headline
    what: str
    figure: str
    values: dict[str, tuple[object, str]]  # name -> (the JSON's value, as shown)
    device: str
    date: str
    commit: str
    record: dict


def read(headline: Headline, root: Path = ROOT) -> Row:
    path = root / RESULTS / headline.file
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{RESULTS}/{headline.file}: {err}") from err
    values = {}
    for name, value in headline.values.items():
        try:
            raw = read_value(record, value)
            values[name] = (raw, format(raw, value.fmt))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{RESULTS}/{headline.file}: {name} = {path_label(value)}: {err}") from err
    shown = {name: text for name, (_, text) in values.items()}
    try:
        what, figure = headline.what.format(**shown), headline.figure.format(**shown)
    except KeyError as err:
        raise ValueError(f"{RESULTS}/{headline.file}: a template names {err}, which has no Value") from err
    date = str(record.get("date", ""))[:10]
    if not date:
        match = re.search(r"(20\d\d)(\d\d)(\d\d)", headline.file)
        date = "-".join(match.groups()) if match else "?"
    return Row(
        headline,
        what,
        figure,
        values,
        short_device(str(record.get("device", "?"))),
        date,
        str(record.get("commit", "?")),
        record,
    )


# ---- rendering ----------------------------------------------------------------------------------
def results_block(root: Path = ROOT, headlines: tuple[Headline, ...] = HEADLINES) -> str:
    """A results table, markers included (the README's by default)."""
    if len(headlines) > MAX_ROWS:
        raise ValueError(f"{len(headlines)} headline figures: a results table holds at most {MAX_ROWS}")
    lines = [
        BEGIN,
        "<!-- Generated by `python -m bench.headline` from bench/headline.py: edit that, not this table. -->",
        "",
        "| what | figure | device, date, commit | result file |",
        "| --- | --- | --- | --- |",
    ]
    for row in (read(h, root) for h in headlines):
        lines.append(
            f"| {row.what} | {row.figure} | {row.device}, {row.date}, {row.commit} | `{RESULTS}/{row.headline.file}` |"
        )
    return "\n".join([*lines, "", END])


def with_block(text: str, block: str, name: str = README) -> str:
    """``text`` (the file ``name``) with the part between its markers, the markers included, replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{name} needs one {BEGIN} line followed by one {END} line")
    return text[:start] + block + text[end + len(END) :]


def _figure_section(row: Row, heading: str) -> list[str]:
    out = ["", heading, "", f"{row.figure}", ""]
    meta = f"`{RESULTS}/{row.headline.file}`: {row.device}, {row.date}, commit {row.commit}"
    if row.record.get("torch"):
        meta += f", torch {row.record['torch']}"
    out += [meta + ".", "", "| value | key path | in the file | shown |", "| --- | --- | --- | --- |"]
    for name, value in row.headline.values.items():
        raw, text = row.values[name]
        label = path_label(value).replace("|", "\\|")
        out.append(f"| `{name}` | `{label}` | `{json.dumps(raw)}` | {text} |")
    if row.record.get("command"):
        out += ["", f"Its command: `{row.record['command']}`."]
    elif row.record.get("header"):
        out += ["", f"Its header: `{row.record['header']}`."]
    return out


def index_page(root: Path = ROOT, tables: dict[str, tuple[Headline, ...]] | None = None) -> str:
    """docs/results_index.md: each figure of the README's table, then those of the model card's alone, each with
    the file it comes from and the key path of each value."""
    tables = TABLES if tables is None else tables
    out = [
        "<!-- Generated by `python -m bench.headline` from bench/headline.py: edit that, not this page. -->",
        "",
        "# Results index",
        "",
        "The README's results table, figure by figure, then the figures the EAGLE head's model card",
        "(`engine/data/eagle/README.md`) adds: the result file under `bench/results/` each comes from, the",
        "device, date and commit that file records, and where in the file every value shown is (its key path:",
        "`.key`, `[index]`, `[field=value]` for the one list item with those fields, `[*]` for every item,",
        "reduced by `min`, `max` or `len`). This page and both tables are rendered by",
        "`python -m bench.headline` from the lists in `bench/headline.py`; `tests/docs/test_headline.py` fails",
        "when one differs from what the files give. Every other measurement is in the",
        "[results log](results.md), and the [Benchmarks](benchmarks.md) page renders every result file.",
    ]
    seen: set[str] = set()
    titles = {README: "## The README", CARD: "## The EAGLE head's model card"}
    for rel, headlines in tables.items():
        rows = [read(h, root) for h in headlines if h.file not in seen]
        if not rows:
            continue
        out += ["", titles.get(rel, f"## {rel}")]
        for row in rows:
            seen.add(row.headline.file)
            out += _figure_section(row, f"### {len(seen)}. {row.what}")
    return "\n".join(out) + "\n"


def rendered(root: Path = ROOT) -> dict[str, str]:
    """Relative path -> the text it should have: each file of `TABLES` with its block rendered, and the index."""
    out = {}
    for rel, headlines in TABLES.items():
        out[rel] = with_block((root / rel).read_text(), results_block(root, headlines), rel)
    out[INDEX] = index_page(root)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The files whose committed text differs from what the result files give."""
    out = []
    for rel, text in rendered(root).items():
        path = root / rel
        if not path.exists() or path.read_text() != text:
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        files = stale()
        for rel in files:
            print(f"{rel} is stale: run python -m bench.headline", file=sys.stderr)
        return 1 if files else 0
    for rel, text in rendered().items():
        path = ROOT / rel
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
