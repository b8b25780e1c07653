"""Hub ids against a local hub cache laid out the way huggingface_hub lays it out (no network here)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from test_loader import save_tiny_tokenizer
from test_safetensors_loader import save_tiny_model
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models import hub
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ROOT = Path(__file__).resolve().parent.parent


def add_to_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Store files as huggingface_hub does: content-addressed blobs, a snapshot of relative symlinks to them,
    and refs/main naming the snapshot's commit. Returns the snapshot folder."""
    repo_folder = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_folder / "snapshots" / COMMIT
    (repo_folder / "blobs").mkdir(parents=True)
    for name, content in files.items():
        blob = repo_folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_folder / "refs").mkdir()
    (repo_folder / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache with a tiny safetensors model, a GGUF-only repo and a snapshot that lacks its weights."""
    cache = tmp_path_factory.mktemp("hub")
    model_folder = tmp_path_factory.mktemp("saved")
    save_tiny_model("qwen3", model_folder)
    save_tiny_tokenizer(model_folder)
    model_files = {path.name: path.read_bytes() for path in model_folder.iterdir()}
    add_to_hub_cache(cache, "tiny-org/tiny-qwen3", model_files)
    add_to_hub_cache(cache, "tiny-org/tiny-gguf", {"tiny-Q8_0.gguf": b"GGUF", "q4/tiny-Q4_1.gguf": b"GGUF"})
    add_to_hub_cache(cache, "tiny-org/no-weights", {"config.json": model_files["config.json"]})
    return cache


@pytest.fixture
def offline_cache(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into its constants at import; these set them
    # after the fact. test_env_variables_reach_a_fresh_process checks the real environment variables.
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("unsloth/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q4_K_M.gguf", True),
        ("org/name:sub/dir/file.gguf", True),
        ("smollm2-135m", False),  # no namespace: the alias, or a typo
        ("org/name/extra", False),
        ("org/name:notes.txt", False),
        ("org/bad--name", False),
        ("./org", False),
        ("/abs/path", False),
    ],
)
def test_is_hub_id(text: str, expected: bool) -> None:
    assert hub.is_hub_id(text) is expected


def test_an_existing_local_path_is_not_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/name")


def test_resolves_a_cached_model_offline(offline_cache: Path) -> None:
    folder = hub.resolve_hub_model("tiny-org/tiny-qwen3")
    assert folder == offline_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    spec, weights = load_safetensors_folder(folder, torch.float32)
    assert spec.family == "qwen3" and spec.num_layers == 2
    assert weights["model.embed_tokens.weight"].shape == (320, 32)


def test_uncached_model_offline_says_so(offline_cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE=1.*not cached"):
        hub.resolve_hub_model("tiny-org/never-downloaded")


def test_snapshot_without_weights_offline(offline_cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="lacks config.json or safetensors weights"):
        hub.resolve_hub_model("tiny-org/no-weights")


def test_gguf_only_repo_lists_its_files_until_one_is_named(offline_cache: Path) -> None:
    with pytest.raises(ModelLoadError) as error:
        hub.resolve_hub_model("tiny-org/tiny-gguf")
    assert "tiny-org/tiny-gguf:tiny-Q8_0.gguf" in str(error.value)
    assert "tiny-org/tiny-gguf:q4/tiny-Q4_1.gguf" in str(error.value)
    path = hub.resolve_hub_model("tiny-org/tiny-gguf:q4/tiny-Q4_1.gguf")
    assert (
        path == offline_cache / "models--tiny-org--tiny-gguf" / "snapshots" / COMMIT / "q4" / "tiny-Q4_1.gguf"
    )


def test_pull_refuses_offline(offline_cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE=1"):
        hub.pull("tiny-org/tiny-qwen3")


def test_unreachable_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    # A complete cached snapshot is used without asking the hub.
    assert hub.resolve_hub_model("tiny-org/tiny-qwen3").name == COMMIT
    with pytest.raises(
        ModelLoadError, match="could not download tiny-org/elsewhere from the Hugging Face hub"
    ):
        hub.resolve_hub_model("tiny-org/elsewhere")


def test_env_variables_reach_a_fresh_process(hub_cache: Path) -> None:
    """The real route: HF_HUB_CACHE and HF_HUB_OFFLINE=1 in the environment of a new process."""
    script = """
import json
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.loader import load_model
model = load_model("tiny-org/tiny-qwen3")
try:
    load_model("tiny-org/never-downloaded")
    uncached = None
except ModelLoadError as error:
    uncached = str(error)
print(json.dumps({"source": str(model.source), "family": model.spec.family,
                  "embed_sum": model.weights["model.embed_tokens.weight"].double().sum().item(),
                  "ids": model.tokenizer.encode("hello world"), "uncached": uncached}))
"""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    snapshot = hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert report["source"] == str(snapshot)
    assert report["family"] == "qwen3"
    _, weights = load_safetensors_folder(snapshot, torch.float32)
    assert report["embed_sum"] == weights["model.embed_tokens.weight"].double().sum().item()
    assert len(report["ids"]) > 0
    assert "HF_HUB_OFFLINE=1" in report["uncached"] and "not cached" in report["uncached"]


# --- online, against a local stand-in for the hub's HTTP API -------------------------------------------


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    """The few hub routes huggingface_hub uses to download: model info, the file tree and file resolution."""

    repos: dict[str, dict[str, bytes]] = {}
    gated: set[str] = set()
    requested_files: list[str] = []

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?")[0]
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            files = self._repo(match[1])
            if files is not None:
                siblings = [{"rfilename": name} for name in files]
                self._send(
                    json.dumps({"id": match[1], "sha": COMMIT, "siblings": siblings}).encode(), send_body
                )
        elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path):
            files = self._repo(match[1])
            if files is not None:
                tree = [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()
                ]
                self._send(json.dumps(tree).encode(), send_body)
        elif match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
            files = self._repo(match[1])
            if files is not None and match[2] not in files:
                self._error(404, "EntryNotFound")
            elif files is not None:
                if send_body:
                    self.requested_files.append(match[2])
                etag = f'"{hashlib.sha256(files[match[2]]).hexdigest()}"'
                self._send(files[match[2]], send_body, {"X-Repo-Commit": COMMIT, "ETag": etag})
        else:
            self._error(404, "RepoNotFound")

    def _repo(self, repo_id: str) -> dict[str, bytes] | None:
        if repo_id in self.gated:
            self._error(403, "GatedRepo")
        elif repo_id not in self.repos:
            self._error(404, "RepoNotFound")
        else:
            return self.repos[repo_id]
        return None

    def _send(self, body: bytes, send_body: bool, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()


# Files of the online repo that TileInfer must not download: pickles, a second (consolidated) copy, a README.
NOT_NEEDED = {"pytorch_model.bin": b"pickle", "consolidated.safetensors": b"copy", "README.md": b"# tiny"}


@pytest.fixture
def online_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeHubHandler]]:
    """An empty hub cache, online, whose endpoint is a local FakeHubHandler server."""
    saved = tmp_path / "saved"
    saved.mkdir()
    save_tiny_model("qwen2", saved)  # sharded: an index and several shards
    save_tiny_tokenizer(saved)
    model_files = {path.name: path.read_bytes() for path in saved.iterdir()}
    FakeHubHandler.repos = {
        "tiny-org/online-qwen2": model_files | NOT_NEEDED,
        "tiny-org/gguf-only": {"tiny-Q8_0.gguf": b"GGUF-q8", "tiny-Q4_1.gguf": b"GGUF-q4"},
        "tiny-org/pickles-only": {"config.json": model_files["config.json"], "pytorch_model.bin": b"pickle"},
    }
    FakeHubHandler.gated = {"tiny-org/gated"}
    FakeHubHandler.requested_files = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    url_template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    yield FakeHubHandler
    server.shutdown()
    server.server_close()


def test_pull_downloads_only_what_the_engine_reads(
    online_hub, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    folder = hub.pull("tiny-org/online-qwen2")
    assert "pulling tiny-org/online-qwen2" in capfd.readouterr().err
    downloaded = sorted(online_hub.requested_files)
    expected = sorted(name for name in online_hub.repos["tiny-org/online-qwen2"] if name not in NOT_NEEDED)
    assert downloaded == expected
    assert sorted(path.name for path in folder.iterdir()) == expected
    spec, weights = load_safetensors_folder(folder, torch.float32)
    assert spec.family == "qwen2" and "model.layers.1.self_attn.k_proj.bias" in weights
    # Once pulled, the model resolves offline from the cache.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert hub.resolve_hub_model("tiny-org/online-qwen2") == folder


def test_online_gguf_repo(online_hub) -> None:
    with pytest.raises(ModelLoadError) as error:
        hub.resolve_hub_model("tiny-org/gguf-only")
    assert "tiny-org/gguf-only:tiny-Q8_0.gguf" in str(error.value)
    assert "tiny-org/gguf-only:tiny-Q4_1.gguf" in str(error.value)
    path = hub.resolve_hub_model("tiny-org/gguf-only:tiny-Q4_1.gguf")
    assert path.read_bytes() == b"GGUF-q4" and online_hub.requested_files == ["tiny-Q4_1.gguf"]


@pytest.mark.parametrize(
    ("model_id", "message"),
    [
        ("tiny-org/pickles-only", "never unpickles"),
        ("tiny-org/unknown", "no such model on the Hugging Face hub: tiny-org/unknown"),
        ("tiny-org/gated", "tiny-org/gated is gated"),
        ("tiny-org/gguf-only:missing.gguf", "tiny-org/gguf-only:missing.gguf: no such file"),
    ],
)
def test_online_errors(online_hub, model_id: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        hub.resolve_hub_model(model_id)
    assert "pytorch_model.bin" not in online_hub.requested_files
