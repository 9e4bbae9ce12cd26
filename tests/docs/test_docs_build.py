"""`mkdocs build --strict` passes, and what the site shows is what the code says.

The cycle page's diagram is `to_mermaid()` and its table is `to_markdown()`, the two agree edge for
row, no generation marker is left in any page, every test the invariants page names exists, and the
benchmark section copes with no results at all.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from speccycle.statemachine.checks import INVARIANTS
from speccycle.statemachine.render import to_markdown, to_mermaid
from speccycle.statemachine.table import TABLE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hooks():
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location("speccycle_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Tables(HTMLParser):
    """Every <table> of a page as rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _tables(page: Path) -> list[list[list[str]]]:
    parser = _Tables()
    parser.feed(page.read_text())
    return parser.tables


def _markdown_rows(markdown: str) -> list[list[str]]:
    rows = []
    for line in markdown.strip().splitlines():
        cells = [" ".join(c.replace("`", "").split()) for c in line.strip().strip("|").split(" | ")]
        if not all(set(c) <= {"-", " "} for c in cells):
            rows.append(cells)
    return rows


def _mermaid_blocks(page: Path) -> list[str]:
    source = page.read_text()
    return [html.unescape(b) for b in re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', source, re.DOTALL)]


def test_the_cycle_page_shows_the_diagram_of_the_table(site_dir: Path):
    blocks = _mermaid_blocks(site_dir / "cycle" / "index.html")
    assert len(blocks) == 1, "the cycle page should hold exactly one Mermaid diagram"
    assert blocks[0].strip() == to_mermaid().strip()


def test_the_cycle_page_shows_the_table(site_dir: Path):
    expected = _markdown_rows(to_markdown())
    tables = [t for t in _tables(site_dir / "cycle" / "index.html") if t and t[0] == expected[0]]
    assert len(tables) == 1, "the transition table is missing from the cycle page"
    assert tables[0] == expected


def test_the_diagram_has_one_edge_per_row_of_the_table():
    edges = re.findall(r"^    (\w+) --> (\w+): (\w+)(?: \[(\w+)\])?$", to_mermaid(), re.MULTILINE)
    rows = [r for r in _markdown_rows(to_markdown())[1:]]
    from_table = [(src, dst, event, "" if guard == "-" else guard) for src, event, guard, dst, *_ in rows]
    assert edges == from_table
    assert len(edges) == len(TABLE)


def test_each_transition_page_shows_its_rows(site_dir: Path):
    for event in sorted({row.event for row in TABLE}):
        page = site_dir / "transitions" / event / "index.html"
        assert page.exists(), f"no page for the transition {event!r}"
        expected = _markdown_rows(to_markdown(tuple(r for r in TABLE if r.event == event)))
        assert expected in [t for t in _tables(page)], f"{event}: its table rows are missing"


def test_no_marker_is_left_unreplaced(site_dir: Path):
    for page in site_dir.glob("**/*.html"):
        assert "<!-- speccycle:" not in page.read_text(), page


# A snippet include that pymdownx.snippets did not expand shows on the page as its own text, escaped or
# not, and mangled by a Markdown formatter (`--8 < --"file"`) too.
UNRENDERED_SNIPPET = re.compile(r"--8\s*(?:<|&lt;|&#60;)\s*--")


def test_no_snippet_or_generation_marker_is_left_in_the_site(site_dir: Path):
    for page in site_dir.glob("**/*.html"):
        text = page.read_text()
        assert not UNRENDERED_SNIPPET.search(text), f"{page}: an unexpanded --8<-- snippet include"
        assert "<!-- speccycle:" not in text and "&lt;!-- speccycle:" not in text, f"{page}: a generation marker"


def test_the_engine_page_shows_the_example_file(site_dir: Path):
    text = html.unescape(re.sub(r"<[^>]+>", "", (site_dir / "engine" / "index.html").read_text()))
    example = (ROOT / "docs" / "examples" / "minimal_engine.py").read_text()
    for line in ("class PagedPool:", "def greedy_decode(prompt: Sequence[int], max_new_tokens: int) -> list[int]:"):
        assert line in example, f"the example no longer has {line!r}: pick another line"
        assert line in text, f"docs/engine.md does not show docs/examples/minimal_engine.py ({line!r} missing)"


def test_the_site_loads_nothing_from_a_cdn(site_dir: Path):
    for page in site_dir.glob("**/*.html"):
        text = page.read_text()
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, page
        assert re.search(r'<script src="[^"]*javascripts/vendor/mermaid\.tiny\.js"', text), page
    assert (site_dir / "javascripts" / "vendor" / "mermaid.tiny.js").stat().st_size > 1_000_000


def test_the_invariants_page_lists_every_invariant(site_dir: Path):
    tables = [t for t in _tables(site_dir / "invariants" / "index.html") if t and t[0][:2] == ["#", "invariant"]]
    assert len(tables) == 1
    assert [(int(r[0]), r[1]) for r in tables[0][1:]] == list(INVARIANTS.items())


def test_every_test_the_docs_name_exists(hooks):
    assert set(hooks.INVARIANT_DOCS) == set(INVARIANTS)
    resolved = hooks.resolve_tests()  # raises if a named test is missing
    for number in (2, 4, 5, 6, 7, 10):
        assert resolved[number], f"invariant {number} has no test"


def test_checked_mode_numbers_come_from_checks_py(hooks):
    assert {2, 3, 4, 5, 6, 7, 8, 9, 10, 12} <= hooks.checked_mode_numbers()


def test_benchmarks_without_results(hooks, monkeypatch):
    monkeypatch.setitem(hooks._BENCH, "results", [])
    assert "No results yet" in hooks.benchmarks_markdown()
    assert hooks.load_results(Path("/nonexistent")) == []


def test_benchmarks_with_results(hooks, monkeypatch, tmp_path):
    result = {
        "benchmark": "cycle_overhead",
        "device": "cpu",
        "commit": "abc",
        "rows": [
            {"config": {"S": 4, "K": 1}, "batch_size": 1, "checked": c, "overhead_us_median": m}
            for c, m in ((False, 1000.0), (True, 2500.0))
        ],
    }
    other = {"benchmark": "something_else", "tokens_per_s": 12.5}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "a.json").write_text(json.dumps(result))
    (tmp_path / "bench" / "results" / "b.json").write_text(json.dumps(other))
    (tmp_path / "bench" / "results" / "broken.json").write_text("{")
    loaded = hooks.load_results(tmp_path)
    assert [name for name, _ in loaded] == ["a.json", "b.json"]
    monkeypatch.setitem(hooks._BENCH, "results", loaded)
    monkeypatch.setitem(hooks._BENCH, "images", {"a.json": "assets/bench/a.png"})
    text = hooks.benchmarks_markdown()
    assert "### a\n" in text and "### b\n" in text  # titled by file name: several files share a benchmark name
    assert "![a](assets/bench/a.png)" in text
    assert "| config | batch_size | checked | overhead_us_median |" in text and "2,500.0" in text
    assert '"tokens_per_s": 12.5' in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert hooks.overhead_plot("a.json", result).startswith(b"\x89PNG")


def test_the_worked_example_keeps_the_invariants(hooks):
    hooks._example("setup")  # loads docs/worked_example.py
    import sys

    example = sys.modules["worked_example"].compute()
    cfg = sys.modules["worked_example"].CONFIG
    bs, n, width = example["bs"], cfg.num_draft_tokens, cfg.accept_width
    assert (example["verify_positions"] == example["L"][:, None] + example["depths"]).all()
    assert example["accept_index"].shape == (bs, width)
    assert example["src"].numel() <= bs * width
    assert example["bonus"].tolist() == [
        int(example["accepted"][b, int(example["accept_len_cut"][b]) - 1]) for b in range(bs)
    ]
    assert ((example["last_correct"] >= 0) & (example["last_correct"] < n)).all()
