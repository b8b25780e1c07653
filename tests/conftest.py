"""Shared test set-up. Without a GPU the Triton kernels run in Triton's interpreter, which must be
switched on before triton is first imported (importing torch does not import it)."""

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread for torch, here and in the processes the tests start. The CPU tests run small
    # steps of a 135M model, ops too small to gain from a second thread; and on a shared two-core machine
    # each op then waits at OpenMP's barrier for a descheduled thread (a 1x576 by 576x1536 linear beside
    # other load: 12 ms with two threads, 0.4 ms with one).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from tileinfer.engine.models.default_model import fetch_default_model  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel, load_model  # noqa: E402

# The tests that start a Ray cluster: the served application's (the `served` fixture) and test_replicas'
# two-node one. They are `serial`: `make test` runs them alone, after the others have run in parallel
# (a cluster's processes beside other tests would slow both, and two clusters on one machine share ports).
RAY_CLUSTER_FIXTURES = {"served", "replicas_url"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The served application's tests run last, in their order: its Ray cluster then runs only while they
    # do (idle, it still takes about a quarter of a core), and never beside test_replicas' own cluster.
    items[:] = sorted(items, key=lambda item: "served" in getattr(item, "fixturenames", ()))
    for item in items:
        if RAY_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def ray_token_outside_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Ray's token file, wherever a test makes one (a launcher's environment, a bench's own `serve run`), is
    the suite's: never the user's ~/.ray/auth_token."""
    with pytest.MonkeyPatch.context() as patch:
        if "RAY_AUTH_TOKEN_PATH" not in os.environ:
            patch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path_factory.mktemp("ray-token") / "auth_token"))
        yield


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default model)."""
    return fetch_default_model(quiet=True)


@pytest.fixture(scope="session")
def transformers_smollm2(smollm2_gguf: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' own reading of that GGUF: its config and its dequantized tensors (read once: each
    reading costs seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(smollm2_gguf))["config"]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)["tensors"]
    return config, tensors


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf: Path) -> LoadedModel:
    """That GGUF loaded by tileinfer.engine.models.loader (float32, on the CPU), once for the files that share
    it: each load costs seconds, and engines and proposers read its weights without changing them."""
    return load_model(str(smollm2_gguf))


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):  # noqa: ANN201
    """The real application, started once for the test run with `serve run` (see tests/serving.py)."""
    from serving import serve_application

    yield from serve_application(tmp_path_factory.mktemp("serve"))
