"""The README's state diagram is the one the table renders."""

from pathlib import Path

from speccycle.statemachine.render import to_mermaid

ROOT = Path(__file__).resolve().parents[2]


def test_readme_diagram_matches_the_table():
    readme = ROOT.joinpath("README.md").read_text()
    block = readme.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block == to_mermaid(), "README diagram is stale: paste speccycle.statemachine.render.to_mermaid()"
