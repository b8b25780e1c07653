"""The one-way layers, kernels <- engine <- proposers <- deployments (ARCHITECTURE.md, section 2): the
import-linter contract in pyproject.toml, which `make test` runs, holds for the tree, and an upward import
planted in a copy of it breaks the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
LAYERS = ("kernels", "engine", "proposers", "deployments")  # installed as tileinfer.<layer>


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the repository's packages, the four layers laid out as they install (tileinfer/<layer>),
    and pyproject.toml."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    ignore = shutil.ignore_patterns("__pycache__")
    for package in (*LAYERS, "bench", "tests"):
        into = tmp_path / "tileinfer" / package if package in LAYERS else tmp_path / package
        shutil.copytree(ROOT / package, into, ignore=ignore)
    return tmp_path


def test_the_tree_keeps_its_layers(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "statement"),
    [
        ("kernels/rmsnorm.py", "from tileinfer.engine.errors import InvalidRequestError"),
        ("engine/spec_decode/speculator.py", "from tileinfer.proposers.draft_ring import RingDrafts"),
        ("proposers/ngram.py", "from tileinfer.deployments.replicas.proposer_build import build_proposer"),
        ("engine/config.py", "from bench.limits import weight_bytes"),
    ],
)
def test_an_upward_import_breaks_the_check(tree: Path, module: str, statement: str) -> None:
    path = tree / ("tileinfer/" + module if module.split("/")[0] in LAYERS else module)
    path.write_text(path.read_text() + f"\n{statement}  # noqa: E402\n")
    result = _lint(tree)
    assert result.returncode != 0
    assert "one-way layers BROKEN" in result.stdout
    importer = "tileinfer." + module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout
