"""The proposer actor: a draft proposer in a GPU actor of its own, beside its engine replica.

Each engine replica starts its own (deployments/replicas/engine_replica.py, start_proposer): their channel is
host memory, so the pair must share a node. With a proposer of GPU or CPU resources, Serve reserves the pair
as one placement group of two bundles on one node (STRICT_PACK, deployments/app.py: engine_bundles), so
the proposer's share counts where replicas are placed, and the proposer runs in the second bundle; with
none, it is pinned to the engine's node. Ray restarts it when its process dies, and it dies with its
engine replica (it is that replica's child).

The engine's RemoteProposer creates a shared-memory channel and calls `attach(channel_name)` once (again
after a failure); from then on every step crosses the channel, served here on a thread, with no Ray call.
For DFlash the engine first asks `hidden_layout()` once, to make a channel that carries the target's
hidden states in this proposer's layout.

With a GPU of its own, the actor sees every GPU of the node (build_app sets SEE_ALL_GPUS), so that it
can map the engine's buffer of DFlash rows as a peer (proposers/device_rows.py), and works on the GPU
that Ray assigned it: each thread that runs CUDA work here selects that GPU first.
"""

from __future__ import annotations

import logging
import os
import threading

import ray
import torch
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.replicas.proposer_build import build_proposer
from tileinfer.engine.models.loader import load_model
from tileinfer.proposers.remote import HiddenLayout, ProposerServer, hidden_layout

logger = logging.getLogger(__name__)

# Ray leaves CUDA_VISIBLE_DEVICES alone in an actor whose environment sets this.
SEE_ALL_GPUS = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# What DFlash reads of the target (a tied LM head is the embedding): the rest stays off this GPU.
DFLASH_TARGET_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


def assigned_gpu_index(gpu_ids: list[int | str], visible: str | None) -> int:
    """The CUDA index of the first GPU Ray assigned, in a process that sees the node's GPUs: Ray's ids
    are entries of the node's CUDA_VISIBLE_DEVICES when that was set (`visible`), else indices."""
    if not gpu_ids:
        raise RuntimeError("the proposer sees every GPU but Ray assigned it none")
    first = str(gpu_ids[0])
    return visible.split(",").index(first) if visible else int(first)


class ProposerActor:
    def __init__(self, args: AppArgs, device: str, dtype: str, draft_ahead: bool = False) -> None:
        """draft_ahead: draft the next block after each answer (build_app decides: a GPU of its own)."""
        logging.basicConfig(level=logging.INFO)  # not a Serve replica: its stderr goes to Ray's logs
        self._gpu: int | None = None  # set when this process sees more GPUs than its own
        if device == "cuda" and os.environ.get(SEE_ALL_GPUS):
            self._gpu = assigned_gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._select_gpu()
        if device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # Ray sets one thread per reserved CPU
        config = args.engine_config(device, dtype)
        # the draft-model and DFlash proposers run parts of the target (DFlash only its embedding and LM
        # head); n-gram needs none of it
        target = None
        if args.proposer != "ngram":
            names = DFLASH_TARGET_WEIGHTS if args.proposer == "dflash" else None
            target = load_model(args.model, config.torch_dtype(), config.torch_device(), names=names)
        self.proposer = build_proposer(config, target)
        try:  # before serving: a first step must not wait out first calls' set-up
            self.proposer.warm_up(args.num_draft)
        except Exception:  # noqa: BLE001 - only a speed-up: a step that fails the same way costs drafts
            logger.exception("warming the proposer up failed; serving anyway")
        self.draft_ahead = draft_ahead
        self._lock = threading.Lock()  # one server at a time calls the proposer
        self._server: ProposerServer | None = None

    def _select_gpu(self) -> None:
        """Make this thread's current GPU the replica's own (the CUDA device is per thread)."""
        if self._gpu is not None:
            torch.cuda.set_device(self._gpu)

    def _serve(self, server: ProposerServer) -> None:
        self._select_gpu()
        server.serve()

    def hidden_layout(self) -> HiddenLayout:
        """The target hidden states this proposer reads (none but for DFlash), asked once at start."""
        return hidden_layout(self.proposer)

    def attach(self, channel_name: str) -> None:
        """Serve the engine's channel `channel_name` from now on, in place of any earlier one."""
        self._select_gpu()  # the server maps the engine's GPU buffer for the current GPU
        try:
            server = ProposerServer(self.proposer, channel_name, self._lock, self.draft_ahead)
        except FileNotFoundError:
            raise RuntimeError(
                f"no shared-memory channel {channel_name!r} on this node: the proposer actor must run on "
                "the engine's node"
            ) from None
        previous, self._server = self._server, server
        if previous is not None:
            previous.stop()  # an engine that re-attached has given up on that channel
        threading.Thread(target=self._serve, args=(server,), name="tileinfer-proposer", daemon=True).start()

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()
