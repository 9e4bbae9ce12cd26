"""Nothing hand-copies the table: the README holds no state diagram of its own (it links the cycle page), and
the cycle page's diagram and table are the markers the site fills from the code at build time
(`docs/hooks.py`, `statemachine.render`)."""

from pathlib import Path

from speccycle.statemachine.render import to_markdown, to_mermaid

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_links_the_rendered_diagram_instead_of_copying_it():
    readme = ROOT.joinpath("README.md").read_text()
    assert "```mermaid" not in readme and "stateDiagram" not in readme
    assert "(docs/cycle.md)" in readme


def test_the_cycle_page_renders_the_diagram_and_table_from_the_code():
    page = ROOT.joinpath("docs", "cycle.md").read_text()
    assert "<!-- speccycle:mermaid -->" in page and "<!-- speccycle:table -->" in page
    assert "stateDiagram" not in page  # no hand copy beside the marker
    assert to_mermaid().startswith("stateDiagram-v2") and "Ready --> Ready: retire" in to_mermaid()
    assert "| `Ready` | `retire` |" in to_markdown()
