"""One namespace: the four folders import as tileinfer.kernels, tileinfer.engine, tileinfer.proposers and
tileinfer.deployments, also where the repository root is first on sys.path (as `python -c`, `python -m`,
pytest and `serve run` from the checkout put it). Their bare names go to whatever else is installed under
them (Hugging Face's `kernels`, which current transformers requires) or fail naming ours
(kernels/bare_names.py), and none of our modules loads under a second name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import kernels  # Hugging Face's
import tileinfer.kernels.rope, tileinfer.deployments.app
from ray._common.utils import import_attr  # what Serve imports an import_path with
failures = {}
for name in ("engine.engine", "proposers.ngram"):
    try:
        __import__(name)
    except ImportError as error:
        failures[name] = str(error)
try:
    import_attr("deployments.app:build_app")  # serve_config.yaml's import_path before the namespace
except ImportError as error:
    failures["deployments.app:build_app"] = str(error)
print(json.dumps({
    "hf_kernels": kernels.__file__,
    "hf_kernels_api": hasattr(kernels, "get_kernel"),
    "ours": tileinfer.kernels.rope.__file__,
    "failures": failures,
    "bare_modules": sorted(
        name for name, module in sys.modules.items()
        if name.split(".")[0] in ("kernels", "engine", "proposers", "deployments")
        # in our folder of that name (a virtualenv inside the checkout holds Hugging Face's kernels)
        and str(getattr(module, "__file__", "") or "").startswith(f"{sys.argv[1]}/{name.split('.')[0]}/")
    ),
}))
"""


def test_bare_names_are_not_ours_from_the_repository_root() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    # Hugging Face's kernels and ours, in one process
    assert Path(seen["hf_kernels"]).parent != ROOT / "kernels" and seen["hf_kernels_api"], seen
    assert seen["ours"] == str(ROOT / "kernels" / "rope.py")
    # a bare name that nothing else installs fails naming the namespace; the old import_path names the new
    assert set(seen["failures"]) == {"engine.engine", "proposers.ngram", "deployments.app:build_app"}
    assert "tileinfer.engine" in seen["failures"]["engine.engine"]
    assert "tileinfer.proposers" in seen["failures"]["proposers.ngram"]
    assert "tileinfer.deployments.app:build_app" in seen["failures"]["deployments.app:build_app"]
    assert seen["bare_modules"] == []  # none of our files under a second name
