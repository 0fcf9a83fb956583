"""The import contract (.importlinter) holds: imports run one way, settings stay at the edge,
the TUI is a client, no cycles.

import-linter reads the source tree under the root package's folder, and backends/, models/
and tui/ install as edgeinfer.backends / .models / .tui (pyproject.toml, package-dir), so the
check runs on a copy of the tree laid out as the installed package: edgeinfer/ and the three
mapped folders under it, with PYTHONPATH and the working directory at the copy."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
CONTRACTS = 6


def _mirror(root: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "edgeinfer", root / "edgeinfer", ignore=skip)
    for mapped in ("backends", "models", "tui"):
        shutil.copytree(REPO / mapped, root / "edgeinfer" / mapped, ignore=skip)
    return root


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), str(REPO / ".importlinter"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_the_import_contract_holds(tmp_path):
    r = _lint(_mirror(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{CONTRACTS} kept, 0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("where, line, broken", [
    # a backend importing the server: an upward import
    ("backends/base.py", "import edgeinfer.server.app",
     "edgeinfer.backends is not allowed to import edgeinfer.server"),
    # a runner reading the settings itself instead of taking the value as an argument
    ("runners/load.py", "from edgeinfer.settings import current",
     "edgeinfer.runners is not allowed to import edgeinfer.settings"),
    # two sibling modules importing each other
    ("formats/kv_cache_types.py", "import edgeinfer.formats.gguf_file",
     None),
])
def test_the_contract_catches_a_breach(tmp_path, where, line, broken):
    """Each kind of breach fails the check (the contract is not vacuous)."""
    root = _mirror(tmp_path)
    if broken is None:      # a cycle: gguf_file imports kv_cache_types, which imports it back
        with open(root / "edgeinfer" / "formats" / "gguf_file.py", "a") as f:
            f.write("\nimport edgeinfer.formats.kv_cache_types  # noqa\n")
    with open(root / "edgeinfer" / where, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    r = _lint(root)
    assert r.returncode != 0, r.stdout
    assert (broken or "No cycles are allowed in edgeinfer.formats") in r.stdout, r.stdout
