"""Models from the Hugging Face hub, through huggingface_hub and its cache.

An id is `org/name` (a safetensors repo) or `org/name:path/in/repo.gguf` (one GGUF file of a repo).
Only the files the engine reads are fetched: safetensors weights, configs, tokenizer and chat
template; never pickles, never remote code. HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE are honoured
by huggingface_hub itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.safetensors_loader import INDEX_FILE, SINGLE_FILE, safetensors_files

GGUF_SEPARATOR = ":"
# What the loader and tokenizer read besides the weights; the weights are chosen per repo (_weight_files).
METADATA_FILES = [
    INDEX_FILE,
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]


def split_hub_id(text: str) -> tuple[str, str | None]:
    """`org/name:file.gguf` -> ("org/name", "file.gguf"); `org/name` -> ("org/name", None)."""
    repo_id, separator, gguf_file = text.partition(GGUF_SEPARATOR)
    return repo_id, (gguf_file if separator else None)


def is_hub_id(text: str) -> bool:
    """True for `org/name` or `org/name:file.gguf` that is not an existing local path."""
    if Path(text).expanduser().exists():
        return False
    repo_id, gguf_file = split_hub_id(text)
    if repo_id.count("/") != 1 or (gguf_file is not None and not gguf_file.endswith(".gguf")):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The model's local snapshot folder (or GGUF file): from the cache when it is complete there,
    else downloaded; with HF_HUB_OFFLINE=1 the cache only."""
    cached = _cached(repo_id, revision)
    if cached is not None and (cached.is_file() or _has_safetensors_model(cached)):
        return cached
    if not constants.HF_HUB_OFFLINE:
        return _download(repo_id, revision)
    offline = (
        f"HF_HUB_OFFLINE=1 is set, so {repo_id} is read from the hub cache ({constants.HF_HUB_CACHE}) only"
    )
    if cached is None:
        raise ModelLoadError(
            f"{offline}, and it is not cached there: run `tileinfer pull {repo_id}` online first"
        )
    gguf_files = sorted(str(path.relative_to(cached)) for path in cached.rglob("*.gguf"))
    if gguf_files:
        raise _name_a_gguf_error(repo_id, gguf_files)
    raise ModelLoadError(
        f"{offline}, and its cached snapshot {cached} lacks config.json or safetensors weights"
    )


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Download (or bring up to date) the model from the hub into the cache, showing progress on stderr."""
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"cannot pull {repo_id}: HF_HUB_OFFLINE=1 is set")
    print(f"pulling {repo_id} into {constants.HF_HUB_CACHE}", file=sys.stderr)
    return _download(repo_id, revision)


def _cached(text: str, revision: str | None) -> Path | None:
    """Whatever the cache holds for this id (a GGUF file or a snapshot folder), or None. huggingface_hub
    checks a snapshot's metadata files against its cached repo listing; the caller checks the weights."""
    repo_id, gguf_file = split_hub_id(text)
    try:
        if gguf_file is not None:
            return Path(
                huggingface_hub.hf_hub_download(repo_id, gguf_file, revision=revision, local_files_only=True)
            )
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=METADATA_FILES, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        return None


def _has_safetensors_model(snapshot: Path) -> bool:
    if not (snapshot / "config.json").is_file():
        return False
    try:
        return all(path.is_file() for path in safetensors_files(snapshot))
    except ModelLoadError:
        return False


def _download(text: str, revision: str | None) -> Path:
    repo_id, gguf_file = split_hub_id(text)
    with _hub_errors(text):
        if gguf_file is not None:
            return Path(huggingface_hub.hf_hub_download(repo_id, gguf_file, revision=revision))
        # model_info fails at once when the hub is unreachable; list_repo_files retries for ~20 s first.
        siblings = huggingface_hub.HfApi().model_info(repo_id, revision=revision).siblings or []
        weight_files = _weight_files(repo_id, revision, [sibling.rfilename for sibling in siblings])
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=[*METADATA_FILES, *weight_files]
            )
        )


def _weight_files(repo_id: str, revision: str | None, repo_files: list[str]) -> list[str]:
    """The safetensors files the model needs: exactly the index's shards, so that a repo that also ships
    another copy (Mistral's consolidated.safetensors) is not downloaded twice."""
    if INDEX_FILE in repo_files:
        index = Path(huggingface_hub.hf_hub_download(repo_id, INDEX_FILE, revision=revision))
        return [str(path.relative_to(index.parent)) for path in safetensors_files(index.parent)]
    if SINGLE_FILE in repo_files:
        return [SINGLE_FILE]
    gguf_files = sorted(name for name in repo_files if name.endswith(".gguf"))
    if gguf_files:
        raise _name_a_gguf_error(repo_id, gguf_files)
    raise ModelLoadError(
        f"{repo_id} has no {SINGLE_FILE} or {INDEX_FILE}; TileInfer reads HF safetensors or GGUF only "
        "and never unpickles (pytorch_model.bin, *.pt)"
    )


def _name_a_gguf_error(repo_id: str, gguf_files: list[str]) -> ModelLoadError:
    listing = "\n".join(f"  {repo_id}{GGUF_SEPARATOR}{name}" for name in gguf_files)
    return ModelLoadError(f"{repo_id} has GGUF files but no safetensors; name one of them:\n{listing}")


@contextlib.contextmanager
def _hub_errors(model_id: str) -> Iterator[None]:
    """Turns huggingface_hub's exceptions into a ModelLoadError that says what went wrong."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        raise ModelLoadError(_hub_error_message(model_id, error)) from error


def _hub_error_message(model_id: str, error: Exception) -> str:
    if isinstance(error, GatedRepoError):
        return f"{model_id} is gated: accept its terms on huggingface.co, then log in (`hf auth login`)"
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"no such model on the Hugging Face hub: {model_id} (or it is private and you are not logged in)"
        )
    if isinstance(error, RevisionNotFoundError):
        return f"{model_id} has no such revision: {error}"
    if isinstance(error, LocalEntryNotFoundError):
        return f"cannot reach the Hugging Face hub and {model_id} is not in the cache: {error}"
    if isinstance(error, EntryNotFoundError):
        return f"{model_id}: no such file in the repository"
    if isinstance(error, HfHubHTTPError):
        return f"the Hugging Face hub refused {model_id}: {error}"
    # The HTTP client's own errors (connection refused, DNS, timeouts) differ across huggingface_hub versions.
    return (
        f"could not download {model_id} from the Hugging Face hub ({type(error).__name__}: {error}); "
        "check the network, or set HF_HUB_OFFLINE=1 to use cached models only"
    )
