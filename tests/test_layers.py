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
PACKAGES = ("kernels", "engine", "proposers", "deployments", "bench", "tests")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the repository's packages and pyproject.toml."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_tree_keeps_its_layers(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "statement"),
    [
        ("kernels/rmsnorm.py", "from engine.errors import InvalidRequestError"),
        ("engine/speculator.py", "from proposers.draft_ring import RingDrafts"),
        ("proposers/ngram.py", "from deployments.proposers import build_proposer"),
        ("engine/config.py", "from bench.model_shapes import SMOLLM2_135M"),
    ],
)
def test_an_upward_import_breaks_the_check(tree: Path, module: str, statement: str) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{statement}  # noqa: E402\n")
    result = _lint(tree)
    assert result.returncode != 0
    assert "one-way layers BROKEN" in result.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout
