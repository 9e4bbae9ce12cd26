"""scripts/gpu_ab_stage.sh: the staged old tree is the old commit's, and ab.sh runs a command in both trees.

A throwaway clone gets one more commit (a file changed, a file added); staging against its parent must
write the changed file's old text, list the added file, and have ab.sh run the command in the old tree (the
changed file as it was, the added one gone) and in the new one, in turn, each with its side, round, commit
and `speccycle` import root.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def test_stage_and_run_both_trees(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    (clone / "README.md").write_text("new readme\n")
    (clone / "added.txt").write_text("added\n")
    _git(clone, "add", "-A")
    _git(clone, "commit", "-qm", "change")
    old_readme = _git(clone, "show", "HEAD~1:README.md")
    (clone / ".gpu" / "p2").mkdir(parents=True)
    (clone / ".gpu" / "p2" / "spec_bench_dev.jsonl").write_text("{}\n")

    script = ROOT / "scripts" / "gpu_ab_stage.sh"  # this checkout's, run in the clone
    subprocess.run(["bash", str(script), "HEAD~1"], cwd=clone, check=True, capture_output=True)
    staged = clone / ".gpu" / "p2"
    assert (staged / "old" / "README.md").read_text().strip() == old_readme
    assert (staged / "old.deleted").read_text().split() == ["added.txt"]

    command = 'echo "$AB $AB_REP $SPECCYCLE_COMMIT $(head -c 10 README.md) $(ls added.txt 2>/dev/null) $PYTHONPATH"'
    env = {"PATH": "/usr/bin:/bin", "AB_DIR": str(tmp_path / "ab")}
    run = subprocess.run(["bash", ".gpu/p2/ab.sh", "2", command], cwd=clone, env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if not line.startswith("==")]
    old, new = _git(clone, "rev-parse", "--short", "HEAD~1"), _git(clone, "rev-parse", "--short", "HEAD")
    assert [line.split()[:3] for line in lines] == [
        ["old", "1", old],
        ["new", "1", new],
        ["old", "2", old],
        ["new", "2", new],
    ]
    assert all("new readme" not in line and "added.txt" not in line for line in lines[0::2])
    assert all("new readme" in line and "added.txt" in line for line in lines[1::2])
    for line in lines:  # `speccycle` imports from the side's own tree
        side = line.split()[0]
        link = Path(line.split()[-1].split(":")[0]) / "speccycle"
        assert link.resolve() == (tmp_path / "ab" / "old" / "tree" if side == "old" else clone).resolve()

    # staged again against another old commit, on the same machine (the same AB_DIR): the old tree is rebuilt
    (clone / "README.md").write_text("newer readme\n")
    _git(clone, "add", "-A")
    _git(clone, "commit", "-qm", "change again")
    subprocess.run(["bash", str(script), "HEAD~1"], cwd=clone, check=True, capture_output=True)
    run = subprocess.run(["bash", ".gpu/p2/ab.sh", "1", command], cwd=clone, env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if not line.startswith("==")]
    assert lines[0].split()[:4] == ["old", "1", new, "new"] and "newer" not in lines[0]
    assert lines[1].split()[3] == "newer"
