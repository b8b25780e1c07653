"""The four folders of this repository import as tileinfer.kernels, tileinfer.engine, tileinfer.proposers and
tileinfer.deployments (pyproject.toml maps them there). Where the repository root is on sys.path (pytest,
`python -m` or `serve run` from the checkout), a bare `import kernels` would find the folder itself: its
__init__ then calls `defer`, so that the name goes to whatever else is installed under it (Hugging Face's
`kernels`, for one), or fails naming TileInfer's, and no module of ours is ever loaded under two names."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def defer(name: str, init_file: str) -> None:
    """Load, in place of the package being imported as `name`, the package of that name found on sys.path
    outside this repository; raise ImportError when there is none."""
    repository = Path(init_file).resolve().parents[1]
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != repository]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ImportError(
            f"TileInfer's {name}/ imports as tileinfer.{name} (serve_config.yaml's import_path: "
            "tileinfer.deployments.app:build_app); install the checkout with `pip install -e .`",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import that reached our folder returns this module
    if spec.loader is not None:
        spec.loader.exec_module(module)
