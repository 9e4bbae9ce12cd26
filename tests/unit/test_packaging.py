"""The distribution ships every subpackage the library imports: pyproject.toml lists packages by hand (the
repository root is the package `speccycle`), so a new folder of modules must be listed or an installed wheel
lacks it while the editable checkout still imports it."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
# folders of the repository that are not part of the installed library
NOT_SHIPPED = {"tests", "bench", "docs", "scripts", "site", ".gpu", ".venv", "speccycle.egg-info"}


def _packages_on_disk() -> set[str]:
    found = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith(".")):
            continue
        found.add(".".join(("speccycle",) + rel.parts))
    return found


def test_every_library_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"
