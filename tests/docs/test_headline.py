"""The README's results table, the EAGLE head's evaluation table and docs/results_index.md are what
`bench/headline.py` renders from the JSON.

All three are rendered again in memory from the result files under bench/results/; a figure typed by hand, a
result file edited or removed, or a headline changed without `python -m bench.headline` fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from speccycle.bench import headline
from speccycle.bench.headline import HEADLINES, MODEL_CARD, TABLES, Headline, Value

ROOT = Path(__file__).resolve().parents[2]


def test_readme_model_card_and_results_index_match_the_result_files():
    expected = headline.rendered(ROOT)
    for rel, text in expected.items():
        assert (ROOT / rel).read_text() == text, f"{rel} is stale: run `python -m bench.headline`"
    assert headline.stale(ROOT) == []


def test_the_readme_table_names_device_date_commit_and_an_existing_file_per_row():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(headline.BEGIN) : readme.index(headline.END)]
    rows = [
        line for line in block.splitlines() if line.startswith("| ") and not line.startswith(("| what |", "| --- |"))
    ]
    assert 5 <= len(rows) == len(HEADLINES) <= headline.MAX_ROWS == 10
    for line, item in zip(rows, HEADLINES):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        device, date, commit = [c.strip() for c in cells[2].rsplit(", ", 2)]
        record = json.loads((ROOT / headline.RESULTS / item.file).read_text())
        assert device == headline.short_device(record["device"]) and commit == record["commit"]
        assert len(date) == 10 and date[:4] == "2026"
        assert cells[3] == f"`{headline.RESULTS}/{item.file}`"


def _copy_tree(tmp_path: Path) -> Path:
    """The rendered files and the result files they read, as they are, under ``tmp_path``."""
    files = {f"{headline.RESULTS}/{h.file}" for h in HEADLINES + MODEL_CARD}
    for rel in (*TABLES, headline.INDEX, *sorted(files)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_a_changed_figure_in_a_result_file_makes_both_files_stale(tmp_path):
    root = _copy_tree(tmp_path)
    assert headline.stale(root) == []
    item = next(h for h in HEADLINES if h.file.startswith("speccycle_bench-") and "speedup" in h.values)
    path = root / headline.RESULTS / item.file
    record = json.loads(path.read_text())
    record["speedup"] = round(record["speedup"] + 0.5, 3)
    path.write_text(json.dumps(record))
    in_tables = [rel for rel, headlines in TABLES.items() if item in headlines]
    assert headline.README in in_tables
    assert headline.stale(root) == [*in_tables, headline.INDEX]
    for rel in in_tables:
        assert f"**{record['speedup']:.3f}x**" in headline.rendered(root)[rel]


def test_a_figure_typed_into_the_readme_table_is_stale(tmp_path):
    root = _copy_tree(tmp_path)
    readme = root / headline.README
    text = readme.read_text()
    first = next(h for h in HEADLINES if "speedup" in h.values)
    shown = headline.read(first, root).values["speedup"][1]
    readme.write_text(text.replace(f"**{shown}x**", "**9.999x**", 1))
    assert headline.stale(root) == [headline.README]


def test_key_paths_pick_one_item_or_fail_with_the_file_named():
    data = {"rows": [{"system": "a", "x": 1.5}, {"system": "b", "x": 2.5}, {"system": "b", "x": 3.0}], "n": 7}
    assert headline.lookup(data, ("rows", {"system": "a"}, "x")) == 1.5
    assert headline.lookup(data, ("rows", 1, "x")) == 2.5
    assert headline.read_value(data, Value(("rows", "*", "x"), reduce="min")) == 1.5
    assert headline.read_value(data, Value(("rows", "*"), reduce="len")) == 3
    for bad in (("rows", {"system": "b"}, "x"), ("rows", {"system": "c"}, "x"), ("rows", 3), ("m",), ("n", "x")):
        with pytest.raises(KeyError):
            headline.lookup(data, bad)
    with pytest.raises(KeyError):
        headline.read_value(data, Value(("rows", "*", "x")))  # a list with no reduction
    assert headline.path_label(Value(("rows", {"system": "a"}, "x"))) == 'rows[system="a"].x'
    assert headline.path_label(Value(("rows", "*", "x"), reduce="min")) == "min(rows[*].x)"


def test_a_headline_that_names_a_missing_value_is_refused(tmp_path):
    item = HEADLINES[0]
    wrong = Headline(item.what, item.figure, item.file, {**item.values, "tau": Value(("no_such_key",))})
    with pytest.raises(ValueError, match=r"tau = no_such_key: .*no key"):
        headline.read(wrong, ROOT)
    unnamed = Headline("{nothing}", item.figure, item.file, item.values)
    with pytest.raises(ValueError, match="a template names"):
        headline.read(unnamed, ROOT)
    with pytest.raises(ValueError, match="at most 10"):
        headline.results_block(ROOT, HEADLINES + HEADLINES)


def test_the_readme_block_markers_are_required():
    with pytest.raises(ValueError, match="needs one"):
        headline.with_block("# no markers\n", headline.results_block(ROOT))
    text = f"before\n{headline.BEGIN}\nold\n{headline.END}\nafter\n"
    assert headline.with_block(text, "NEW") == "before\nNEW\nafter\n"


def test_the_model_card_table_is_the_shipped_heads_and_short():
    card = (ROOT / headline.CARD).read_text()
    assert card.count(headline.BEGIN) == card.count(headline.END) == 1
    assert len(card.splitlines()) <= 90, "the EAGLE head's model card stays short: its history is in docs/training.md"
    evals = [h for h in MODEL_CARD if h.file.startswith("train_draft_eval-")]
    assert evals, "the model card shows the head's own evaluation"
    for item in evals:  # every config of the evaluated head, and no other head
        record = json.loads((ROOT / headline.RESULTS / item.file).read_text())
        assert list(record["heads"]) == ["s18.eagle"]


def test_short_device_names():
    assert headline.short_device("NVIDIA H100 80GB HBM3") == "H100"
    assert headline.short_device("NVIDIA H200") == "H200"
    assert headline.short_device("x86_64 (2 threads)") == "x86_64, 2 threads"
