"""mkdocs hook: every part of the site that is derived from code is generated here, at build time.

A page asks for generated Markdown with a marker on a line of its own:

    <!-- speccycle:mermaid -->              the state diagram, `render.to_mermaid()`
    <!-- speccycle:table -->                the transition table, `render.to_markdown()`
    <!-- speccycle:fusions -->              the declared fusions, `render.fusions_markdown()`
    <!-- speccycle:rows:EVENT -->           the table rows of one event
    <!-- speccycle:ops:EVENT -->            the backend ops those rows call, with their docstrings
    <!-- speccycle:record:CLASS -->         the fields of a record (core/records.py), shapes included
    <!-- speccycle:example:NAME -->         a section of the worked example (docs/worked_example.py)
    <!-- speccycle:invariants -->           the invariants and the tests that check them
    <!-- speccycle:benchmarks -->           plots and tables of bench/results/*.json
    <!-- speccycle:readme-commands -->      the README's two commands
    <!-- speccycle:cli -->                  the subcommands `speccycle` has now
    <!-- speccycle:demo -->                 the output of `speccycle demo`, run during the build
    <!-- speccycle:attention-rule -->       the attention rule of core/ports.py's docstring

An unknown marker, a test named below that does not exist, or a failing generator stops the build.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import importlib.util
import inspect
import io
import json
import logging
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("mkdocs.hooks.speccycle")
MARKER = re.compile(r"^<!-- speccycle:([a-z-]+)(?::([\w.-]+))? -->[ \t]*$", re.MULTILINE)

# ---- invariants: their statements (docs/invariants.md) and the tests that check them -----------
# Tests are `path::function`, `path::function_glob*` or `path::Class.method` (a rule or invariant of
# a Hypothesis machine). Every test named `test_invariant_<n>_*` anywhere under tests/ is added to
# invariant n automatically. `checked` says how checked mode covers it beyond the `require(..., n)`
# calls found in statemachine/checks.py.
PROPERTY = "tests/property"
KERNELS = "tests/kernels"
INVARIANT_DOCS: dict[int, dict] = {
    1: {
        "statement": "`K == 1` implies `N == S + 1`; `N - 1 <= K + (S - 1) K^2`; `S == 0` (no draft) implies `N == 1`; "
        "invalid configs raise a clear error.",
        "tests": [],
        "checked": "at construction: `SpecConfig` refuses an invalid config",
    },
    2: {
        "statement": "Draft forward `j` of request `b` runs at `L_b + j` with the tokens its family pairs there; "
        "verify row positions are `L_b + depth`.",
        "tests": [
            f"{PROPERTY}/test_regressions.py::test_draft_forward_j_runs_at_L_plus_j_not_L_plus_j_plus_1",
            f"{PROPERTY}/test_regressions.py::test_advancing_the_position_before_the_forward_is_caught",
            f"{PROPERTY}/test_regressions.py::test_draft_leaves_positions_and_seq_lens_as_it_found_them",
        ],
    },
    3: {
        "statement": "Draft slots are all distinct and inside the request's reservation; `P > 1` handled "
        "(partial last page).",
        "tests": [f"{PROPERTY}/test_cycle_machine.py::TestCycleMachine"],
    },
    4: {
        "statement": "Parents precede children; each mask row is prefix + ancestors + self; every packed form "
        "equals the full mask.",
        "tests": [f"{KERNELS}/test_cycle_kernels.py::test_tree_mask_full_and_packed"],
    },
    5: {
        "statement": "`accept_index[b, 0]` is the root; entries stay in the request's block, strictly increase, "
        "form a parent-to-child chain, `-1` after `accept_len`; `1 <= accept_len <= min(S + 1, N)`.",
        "tests": [],
    },
    6: {
        "statement": "The bonus is read at stride `S + 1`; a wider stride is a test failure, not an accident.",
        "tests": [f"{PROPERTY}/test_regressions.py::test_bonus_is_read_at_stride_S_plus_1_not_N"],
    },
    7: {
        "statement": "KV moves are in bounds, of size `<= bs * (S + 1)`; after compaction `[L, L + accept_len)` "
        "holds the accepted path.",
        "tests": [f"{PROPERTY}/test_regressions.py::test_kv_move_is_sized_by_accept_width_not_bs_times_N"],
    },
    8: {
        "statement": "Over any run, slots allocated = committed + in flight; nothing leaks, nothing is freed twice.",
        "tests": [
            f"{PROPERTY}/test_cycle_machine.py::CycleMachine.pool_matches_model",
            f"{PROPERTY}/test_cycle_machine.py::CycleMachine.teardown",
        ],
    },
    9: {
        "statement": "Compaction covers every per-row field of the verified record.",
        "tests": [],
        "checked": "every field of `RowOutputs` is gathered by one loop (`gather_rows`) and checked after accept "
        "and compact",
    },
    10: {
        "statement": "Lossless, greedy: committed tokens equal target-only greedy decoding, for every config "
        "and backend.",
        "tests": [
            f"{PROPERTY}/test_cycle_machine.py::CycleMachine.finished_outputs_are_greedy",
            "tests/docs/test_minimal_engine.py::test_minimal_engine_equals_greedy_decoding",
        ],
    },
    11: {
        "statement": "Lossless, sampling: the committed-token distribution equals the target's (statistical test, "
        "fixed seeds).",
        "tests": [
            "tests/property/test_cycle_sampling.py::test_committed_tokens_follow_the_target_through_the_cycle",
            "tests/property/test_cycle_sampling.py::test_detects_a_reranked_sampled_tree",
            "tests/property/test_sampling.py::test_chain_first_token_follows_target",
            "tests/property/test_sampling.py::test_tree_first_token_follows_target",
            "tests/property/test_sampling.py::test_first_two_tokens_follow_target_jointly",
        ],
    },
    12: {
        "statement": "`last_correct_step_indices` lies in `[0, N)` and equals `accept_len - 1` for chains.",
        "tests": [
            f"{PROPERTY}/test_tree_math.py::test_invariant_5_greedy_verify_matches_the_walk",
            f"{PROPERTY}/test_recurrent_block.py::TestRecurrentCycleMachine",
            "tests/e2e/test_hybrid_lossless.py::test_hybrid_tree_commits_rows_off_the_first_branch",
        ],
        "checked": "a recurrent pool that reports `state_lens` holds exactly `L` tokens per live request, with "
        "no uncommitted verify rows",
    },
    13: {
        "statement": "Block drafts (DFlash): `correct_len = cumprod(cand[:, 1:] == target[:, :-1]).sum()`, "
        "in `[0, B - 1]`.",
        "tests": [f"{PROPERTY}/test_recurrent_block.py::TestRecurrentCycleMachine"],
        "checked": "every block verify: `accept_len == correct_len + 1`, the accepted rows are `0..correct_len`",
    },
    14: {
        "statement": "Every fast kernel equals its reference (exactly for integer outputs).",
        "tests": [
            f"{KERNELS}/test_cycle_kernels.py::test_argmax_equals_torch_with_ties",
            f"{KERNELS}/test_cycle_kernels.py::test_topk_equals_softmax_topk",
            f"{KERNELS}/test_cycle_kernels.py::test_rerank_tree_equals_reference",
            f"{KERNELS}/test_cycle_kernels.py::test_verify_greedy_equals_reference",
            f"{KERNELS}/test_cycle_kernels.py::test_plan_and_move_kv_equal_reference",
            f"{KERNELS}/test_backend_choice.py::test_rocm_fp8_logits_take_softmax_max_and_others_the_argmax_kernel",
            f"{KERNELS}/test_recurrent_kernels.py::test_invariant_14_selective_scan_tree_kernel_equals_reference",
            f"{KERNELS}/test_sampling_kernels.py::test_tree_kernel_equals_reference",
        ],
    },
    15: {
        "statement": "A page in the KV pool's prefix cache is read-only: shared between requests (or kept for later "
        "ones), it holds only full pages of committed tokens whose KV is final in every cache, and no row of any "
        "request (prefill past its cached length, draft extend, verify rows, draft scratch) writes it.",
        "tests": [
            f"{PROPERTY}/test_prefix_cache.py::TestPrefixPoolMachine",
            "tests/unit/test_prefix_scheduler.py::test_multi_turn_conversations_under_kv_pressure_equal_autoregressive",
        ],
        "checked": "the prefill's rows past each cached length, the draft extend's rows, every verify and draft "
        "scratch slot checked against the pool's `shared_pages()`",
    },
    16: {
        "statement": "A constrained request's committed tokens are always accepted by its grammar, and after "
        "every compaction its matcher stands exactly after them (docs: constrained).",
        "tests": [
            "tests/unit/test_grammar.py::test_constrained_greedy_equals_constrained_autoregressive",
            "tests/unit/test_grammar.py::test_the_scheduler_keeps_constrained_requests_lossless_through_retraction_and_"
            "staggered_arrival",
            f"{PROPERTY}/test_grammar_sampling.py::test_constrained_samples_follow_the_masked_target_through_the_cycle",
            "tests/e2e/test_grammar_lossless.py::test_constrained_speculative_equals_constrained_autoregressive",
        ],
        "checked": "every `Compacted` and `Ready` record: each constrained request's matcher has consumed exactly "
        "its output, a freshly compiled matcher accepts that output and ends in the same state (equal masks)",
    },
    17: {
        "statement": "A forward draft's `Ready` record holds its depth-1 top-K or declares it pending "
        "(`topk_pending`: no top-K, q or candidates held, the draft hidden state held): the draft extend defers it "
        "exactly in a cycle of S == 0 over a draft that computes logits from its hidden state, no shape that drafts "
        "runs from a pending record, and the `first_level` row computes the top-K the full extend would have.",
        "tests": [
            "tests/unit/test_deferred_first_level.py::test_random_shape_sequences_through_S0_equal_autoregressive",
        ],
        "checked": "every `Ready` record (pending: nothing stale held, the hidden state held, the draft able; else a "
        "shape that drafts holds a K-wide top-K), every extend (pending exactly when S == 0 and the draft defers) "
        "and the `first_level` row (nothing else changed)",
    },
}
# Not an invariant of its own: the K == 1 fast path (see backends.md).
EXTRA_TESTS = [
    f"{PROPERTY}/test_regressions.py::test_argmax_fast_path_picks_the_true_maximum_where_low_precision_softmax_ties"
]


def _defined_tests(path: Path) -> set[str]:
    """``function`` and ``Class.method`` names defined at the top level of a test file."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
        elif isinstance(node, ast.Assign):  # e.g. TestCycleMachine = CycleMachine.TestCase
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def resolve_tests(root: Path = ROOT) -> dict[int, list[str]]:
    """Invariant number -> the concrete test ids that check it. Raises if a named test is missing."""
    defined = {p.relative_to(root).as_posix(): _defined_tests(p) for p in sorted(root.glob("tests/**/test_*.py"))}
    out: dict[int, list[str]] = {}
    missing = []
    for number, doc in INVARIANT_DOCS.items():
        ids: list[str] = []
        for ref in doc["tests"]:
            path, _, name = ref.partition("::")
            found = sorted(n for n in defined.get(path, ()) if fnmatch.fnmatchcase(n, name))
            if not found:
                missing.append(ref)
            ids += [f"{path}::{n}" for n in found]
        for path, names in defined.items():
            ids += [f"{path}::{n}" for n in sorted(names) if n.startswith(f"test_invariant_{number}_")]
        out[number] = list(dict.fromkeys(ids))
    for ref in EXTRA_TESTS:
        path, _, name = ref.partition("::")
        if name not in defined.get(path, ()):
            missing.append(ref)
    if missing:
        raise PluginError(f"docs name tests that do not exist (update INVARIANT_DOCS in docs/hooks.py): {missing}")
    return out


def checked_mode_numbers(root: Path = ROOT) -> set[int]:
    """The invariant numbers that statemachine/checks.py validates: the literal of every ``require(..., n, ...)``."""
    tree = ast.parse((root / "statemachine" / "checks.py").read_text())
    numbers = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, int):
                numbers.add(node.args[1].value)
    return numbers


def invariants_markdown() -> str:
    from speccycle.statemachine.checks import INVARIANTS

    if set(INVARIANTS) != set(INVARIANT_DOCS):
        raise PluginError(
            f"checks.INVARIANTS has {sorted(INVARIANTS)}, docs/hooks.py INVARIANT_DOCS {sorted(INVARIANT_DOCS)}"
        )
    tests, checked = resolve_tests(), checked_mode_numbers()
    summary = ["| # | invariant | checked mode | tests |", "| --- | --- | --- | --- |"]
    sections = []
    for number, name in INVARIANTS.items():
        doc = INVARIANT_DOCS[number]
        mode = doc.get("checked") or ("every boundary" if number in checked else "-")
        count = f"{len(tests[number])}" + (" (open)" if "open" in doc else "")
        summary.append(f"| {number} | [{name}](#invariant-{number}) | {mode} | {count} |")
        body = [f"### {number}. {name} {{#invariant-{number}}}", "", doc["statement"], ""]
        body.append(f"- **Checked mode:** {mode}.")
        if tests[number]:
            body.append("- **Tests:**")
            body += [f"    - `{t}`" for t in tests[number]]
        if "open" in doc:
            body.append(f"- **Open:** {doc['open']}.")
        sections.append("\n".join(body) + "\n")
    return "\n".join(summary) + "\n\n" + "\n".join(sections)


# ---- records and ops ----------------------------------------------------------------------------
def record_markdown(class_name: str) -> str:
    """The fields of a record or port class, with the shape comment each carries in its source."""
    from speccycle.core import ports, records

    for module in (records, ports):
        cls = getattr(module, class_name, None)
        if cls is not None:
            break
    else:
        raise PluginError(f"speccycle:record:{class_name}: no such class in core/records.py or core/ports.py")
    source_path = Path(inspect.getsourcefile(module)).resolve()  # the package may be imported through a link
    lines = source_path.read_text().splitlines()
    node = next(n for n in ast.parse("\n".join(lines)).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    rows = ["| field | type | shape and meaning |", "| --- | --- | --- |"]
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            line = lines[item.lineno - 1]
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            comment = re.sub(r"(?<!\w)(\[[^\]]*\])", r"`\1`", comment.replace("|", "\\|"))  # shapes as code
            annotation = ast.unparse(item.annotation)  # a `|` inside a code span is not a cell separator
            rows.append(f"| `{item.target.id}` | `{annotation}` | {comment} |")
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    rel = source_path.relative_to(ROOT).as_posix()
    return f"**`{class_name}`** (`{rel}`): {doc}\n\n" + "\n".join(rows) + "\n"


def rows_markdown(event: str) -> str:
    from speccycle.statemachine.render import to_markdown
    from speccycle.statemachine.table import TABLE

    rows = tuple(r for r in TABLE if r.event == event)
    if not rows:
        raise PluginError(f"speccycle:rows:{event}: no row of the table has the event {event!r}")
    return to_markdown(rows)


def ops_markdown(event: str) -> str:
    from speccycle.backends.torch import TorchBackend
    from speccycle.statemachine.table import TABLE

    ops = list(dict.fromkeys(op for r in TABLE if r.event == event for op in r.ops))
    if not ops:
        return "This transition calls no backend op: it only moves host-side bookkeeping and the pool's pages.\n"
    out = []
    for op in ops:
        method = getattr(TorchBackend, op, None)
        if method is None:
            raise PluginError(f"the table names op {op!r}, which TorchBackend lacks")
        doc = (inspect.getdoc(method) or "").split("\n\n")[0].replace("\n", " ")
        out.append(f"- `{op}`: {doc}")
    return "\n".join(out) + "\n"


# ---- quickstart ---------------------------------------------------------------------------------
def readme_commands() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"```bash\n.*?```\n", readme, re.DOTALL)
    if match is None:
        raise PluginError("README.md has no ```bash block with the two commands")
    return match.group(0)


def cli_markdown() -> str:
    from speccycle.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {a.dest: a.help for a in sub._choices_actions}
    return "\n".join(f"- `speccycle {name}`: {helps.get(name, '')}" for name in sub.choices) + "\n"


def demo_markdown() -> str:
    from speccycle.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(["demo", "--trace-lines", "8"])
    if rc != 0:
        raise PluginError(f"`speccycle demo` exited {rc} during the docs build:\n{buffer.getvalue()}")
    return "```console\n$ .venv/bin/speccycle demo --trace-lines 8\n" + buffer.getvalue() + "```\n"


def attention_rule() -> str:
    from speccycle.core import ports

    doc = inspect.getdoc(ports) or ""
    block = re.search(r"\n\n((?:    .*\n?)+)", doc)
    if block is None:
        raise PluginError("core/ports.py's docstring no longer has an indented attention rule")
    return "```text\n" + "\n".join(line[4:] for line in block.group(1).rstrip().splitlines()) + "\n```\n"


# ---- benchmarks ---------------------------------------------------------------------------------
_BENCH: dict[str, object] = {"results": [], "images": {}}


def load_results(root: Path = ROOT) -> list[tuple[str, dict]]:
    out = []
    for path in sorted((root / "bench" / "results").glob("*.json")):
        try:
            out.append((path.name, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as err:
            log.warning("skipping unreadable benchmark result %s: %s", path.name, err)
    return out


def _config_label(config) -> str:
    if isinstance(config, dict):
        return " ".join(f"{k}={v}" for k, v in config.items())
    return str(config)


def _flatten(row: dict) -> dict:
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out[key] = _config_label(value)
        elif isinstance(value, float):
            out[key] = f"{value:,.1f}"
        else:
            out[key] = value
    return out


def overhead_plot(name: str, result: dict) -> bytes | None:
    """A bar chart of a cycle_overhead result: median overhead per cycle, unchecked and checked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result.get("rows", [])
    groups = list(dict.fromkeys((_config_label(r["config"]), r["batch_size"], r.get("backend")) for r in rows))
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(groups)), 3.6), dpi=110)
    width = 0.38
    for offset, checked, color in ((-width / 2, False, "#5c6bc0"), (width / 2, True, "#ef6c00")):
        values = []
        for config, batch, backend in groups:
            match = [
                r["overhead_us_median"]
                for r in rows
                if (_config_label(r["config"]), r["batch_size"], r.get("backend")) == (config, batch, backend)
                and r["checked"] == checked
            ]
            values.append(match[0] / 1000 if match else 0.0)
        ax.bar(
            [i + offset for i in range(len(groups))],
            values,
            width,
            label="checked" if checked else "unchecked",
            color=color,
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{c}\nbs={b}" + (f"\n{k}" if k else "") for c, b, k in groups], fontsize=8)
    ax.set_ylabel("median overhead per cycle (ms)")
    ax.set_title(f"{Path(name).stem}: {result.get('device', '?')}, commit {result.get('commit', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def benchmarks_markdown() -> str:
    results = _BENCH["results"]
    if not results:
        return (
            '!!! note "No results yet"\n'
            "    `bench/results/` holds no JSON file. Run a benchmark, e.g. "
            "`.venv/bin/python -m bench.cycle_overhead`, and build the docs again.\n"
        )
    out = []
    for name, result in results:
        meta = ", ".join(f"{k}: `{result[k]}`" for k in ("device", "date", "commit", "torch") if k in result)
        out.append(f"### {Path(name).stem}\n\n`bench/results/{name}`. {meta}\n")
        if result.get("note"):
            out.append(f"*{result['note']}*\n")
        image = _BENCH["images"].get(name)
        if image:
            out.append(f"![{Path(name).stem}]({image})\n")
        rows = result.get("rows")
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            flat = [_flatten(r) for r in rows]
            keys = list(dict.fromkeys(k for r in flat for k in r))
            table = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            table += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in flat]
            out.append("\n".join(table) + "\n")
        else:
            scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
            out.append("```json\n" + json.dumps(scalars, indent=2) + "\n```\n")
    return "\n".join(out)


# ---- mkdocs events ------------------------------------------------------------------------------
def on_files(files, config):
    """Load the benchmark results and add their plots to the site as generated files."""
    _BENCH["results"] = load_results()
    _BENCH["images"] = {}
    for name, result in _BENCH["results"]:
        if result.get("benchmark") != "cycle_overhead":
            continue
        png = overhead_plot(name, result)
        if png is None:
            continue
        uri = f"assets/bench/{Path(name).stem}.png"
        files.append(File.generated(config, uri, content=png))
        _BENCH["images"][name] = uri  # relative to docs/benchmarks.md; mkdocs rewrites it per page
    return files


def _generate(kind: str, arg: str | None) -> str:
    simple = {
        "mermaid": lambda: "```mermaid\n" + _mermaid() + "```\n",
        "table": lambda: _table(),
        "invariants": invariants_markdown,
        "benchmarks": benchmarks_markdown,
        "readme-commands": readme_commands,
        "cli": cli_markdown,
        "demo": demo_markdown,
        "attention-rule": attention_rule,
        "fusions": _fusions,
    }
    with_arg = {"rows": rows_markdown, "ops": ops_markdown, "record": record_markdown, "example": _example}
    if kind in simple and arg is None:
        return simple[kind]()
    if kind in with_arg and arg is not None:
        return with_arg[kind](arg)
    raise PluginError(f"unknown docs marker <!-- speccycle:{kind}{':' + arg if arg else ''} -->")


def _mermaid() -> str:
    from speccycle.statemachine.render import to_mermaid

    return to_mermaid()


def _table() -> str:
    from speccycle.statemachine.render import to_markdown

    return to_markdown()


def _fusions() -> str:
    from speccycle.statemachine.render import fusions_markdown

    return fusions_markdown()


def _example(name: str) -> str:
    if "worked_example" not in sys.modules:  # loaded by path: mkdocs restores sys.path after loading hooks
        spec = importlib.util.spec_from_file_location("worked_example", Path(__file__).with_name("worked_example.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["worked_example"] = module
    return sys.modules["worked_example"].render(name)


def on_page_markdown(markdown, page, config, files):
    def replace(match: re.Match) -> str:
        try:
            return _generate(match.group(1), match.group(2)).rstrip("\n")
        except PluginError:
            raise
        except Exception as err:  # a generator that fails is a broken build, with the page named
            raise PluginError(f"{page.file.src_uri}: {match.group(0)} failed: {err!r}") from err

    return MARKER.sub(replace, markdown)
