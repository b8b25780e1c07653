"""Triton's on-disk kernel cache lives under TileInfer's cache root ($TILEINFER_CACHE/triton) unless
TRITON_CACHE_DIR is set, in any process that imports a kernel module, even one that imported triton first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# triton first, then a kernel module; what Triton itself reports as its cache folder
PROBE = "import triton; import tileinfer.kernels.sampling; "
PROBE += "from tileinfer.engine.models.default_model import cache_dir; "
PROBE += "print(triton.knobs.cache.dir); print(cache_dir())"


def _probe(tmp_path: Path, triton_cache_dir: str | None) -> list[str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"}
    env.update(TILEINFER_CACHE=str(tmp_path / "root"), TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    if triton_cache_dir is not None:
        env["TRITON_CACHE_DIR"] = triton_cache_dir
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("preset", [False, True])
def test_triton_cache_under_tileinfer_cache(tmp_path: Path, preset: bool) -> None:
    own = str(tmp_path / "mine")
    triton_dir, root = _probe(tmp_path, own if preset else None)
    assert root == str(tmp_path / "root")  # engine and kernels share the one root
    assert triton_dir == (own if preset else str(tmp_path / "root" / "triton"))
