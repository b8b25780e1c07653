"""The engine deployment: replicas that each own an Engine, and their client in each ingress replica.

Outputs cross once per step per ingress replica, not once per token per request. Each ingress replica
(deployments/replicas/engine_client.py) opens ONE long-lived Serve streaming call to each engine replica,
`outputs(subscriber_id)`, and submits and aborts requests with plain calls. After each step the engine
thread puts one list of Delta tuples per subscriber on that subscriber's queue
(deployments/replicas/engine_loop.py); the stream yields whatever lists are ready, joined into one item. So
the Ray items per second through this actor follow the step rate times the number of ingress replicas, where
a stream per request made them the step rate times the number of requests (ray#52746: Serve's per-item
cost compounds past ~32 streams), competing for the GIL with the engine thread.

Every call an ingress makes for a request names the engine replica it is meant for (routing.ROUTE_KWARG):
Serve's router (deployments/replicas/engine_router.py) sends it there, and a call that reached another replica
(its own is gone) is refused with WrongReplicaError, so a request never lands where no stream reads it.

The engine here runs without text work (EngineConfig.detokenize False): it ends requests on stop
tokens and max_tokens, and the ingress replicas, which scale with num_ingress_replicas, detokenize
and find stop strings (tileinfer.engine.text.detokenizer.TextStream), aborting a request once its stop string
shows.

Failures: a subscriber's stream that ends aborts all its requests here. Serve cancels it when the
ingress replica stops reading or shuts down; Ray does not when the caller's process dies (measured:
a killed ingress replica's requests ran to their end), so a stream whose heartbeats (every
HEARTBEAT_S) stop for SUBSCRIBER_LEASE_S ends too. An engine replica that dies ends the ingress's stream
to it: the ingress moves the requests that had no token yet to another replica and fails the others (an
OpenAI error, in band once streaming), while Serve starts a new replica.

With speculative decoding in a proposer actor, each replica starts its own on its node (start_proposer;
deployments/replicas/proposer_actor.py says why and how they are placed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from prometheus_client import Metric
from ray import serve
from ray.actor import ActorHandle
from ray.serve.exceptions import RayServeException
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.replicas.autoscaling import SEQUENCES_METRIC
from tileinfer.deployments.replicas.engine_loop import (
    ENGINE_SWITCH_INTERVAL_S,
    Delta,
    EngineLoop,
    UnknownSubscriberError,
)
from tileinfer.deployments.replicas.proposer_actor import ProposerActor
from tileinfer.deployments.replicas.proposer_build import VERIFY_COST_PER_DRAFT, build_engine, draft_cost
from tileinfer.deployments.replicas.routing import cached_block_keys
from tileinfer.deployments.replicas.serve_logs import route_to_serve
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import TileInferError
from tileinfer.engine.models.loader import load_model
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.proposers.channel import ChannelCapacity
from tileinfer.proposers.remote import RemoteProposer

logger = logging.getLogger(__name__)

ATTACH_AT_START_S = 60.0  # the engine waits this long for its proposer before it serves without one
ATTACH_CALL_TIMEOUT_S = 30.0
PROPOSER_START_S = 600.0  # DFlash: the engine waits this long for the proposer to say what it reads
HEARTBEAT_S = 2.0  # an ingress replica tells the engine this often that it still reads its stream
SUBSCRIBER_LEASE_S = 20.0  # a stream without a heartbeat for this long ends, aborting its requests


class WrongReplicaError(TileInferError):
    """A call meant for another engine replica reached this one (Serve routes a call whose replica is gone
    to any other, which refuses it: the caller then knows that replica is gone)."""


@dataclasses.dataclass(frozen=True)
class EngineReplica:
    """Which engine replica this is: Serve's replica id, its rank (the `engine` label of its metrics)
    and its Ray node."""

    replica_id: str
    rank: int
    node_id: str
    app_name: str = ""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    vocab_size: int  # the token ids a request may hold: [0, vocab_size) (Engine.check_request)
    device: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str


# Serve learns that a replica's process died from its next health check (the check fails at once): every
# 2 s, so a dead replica is replaced within about 2 s plus its start (10 s: /health was 13-15 s back on
# the CPU, 6 s of it before Serve noticed). The check itself is a flag read.
@serve.deployment(name="Engine", health_check_period_s=2)
class EngineDeployment:
    async def __init__(
        self,
        args: AppArgs,
        device: str,
        dtype: str,
        proposer_options: dict[str, Any] | None = None,
        draft_ahead: bool = False,
    ) -> None:
        """proposer_options: the Ray options of this replica's proposer actor
        (deployments/replicas/proposer_actor.py), when it has one; draft_ahead: it drafts while this engine
        verifies, so its drafts cost about nothing here.

        The model loads, and the engine builds and warms up, on a worker thread: the replica's event
        loop stays free for Serve's own calls."""
        route_to_serve()
        self.replica = _this_replica()
        self.routing_decisions: dict[str, dict[str, int]] = {}  # subscriber -> its ingress's counts
        if device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # Ray sets one thread per reserved CPU
        # a share of a GPU (replicas side by side on one): its KV cache takes no more than that share
        gpu_share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)
        config = args.engine_config(device, dtype, gpu_memory_share=gpu_share if 0 < gpu_share < 1 else 1.0)
        config = dataclasses.replace(config, detokenize=False)  # the ingress does
        self.proposer: RemoteProposer | None = None
        self.proposer_actor: ActorHandle | None = None  # held: Ray ends an actor whose handles are all gone
        if proposer_options is not None:
            name = f"{self.replica.app_name}#Proposer#{self.replica.replica_id}"
            proposer = self.proposer_actor = start_proposer(
                proposer_options, name, args, device, dtype, draft_ahead
            )

            def attach(channel_name: str) -> None:  # on the RemoteProposer's own thread, never per step
                ray.get(proposer.attach.remote(channel_name), timeout=ATTACH_CALL_TIMEOUT_S)

            hidden = None
            if args.proposer == "dflash":  # the layers to capture: the engine must know them before it starts
                hidden = await asyncio.wait_for(proposer.hidden_layout.remote(), PROPOSER_START_S)
            # a step carries at most max_num_batched_tokens hidden rows; a longer prompt's cross over several
            capacity = ChannelCapacity(
                max_requests=args.max_num_seqs, max_drafts=args.num_draft,
                max_step_rows=args.max_num_batched_tokens,
            )  # fmt: skip
            self.proposer = RemoteProposer(
                attach, capacity, args.proposer_timeout_s, hidden=hidden, device=config.torch_device(),
                use_ring=args.draft_ring,
            )  # fmt: skip
        self.engine = await asyncio.to_thread(self._build_engine, args.model, config, draft_ahead)
        if device != "cpu":  # the engine thread is host-bound there: it must not wait for the GIL
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self.loop = EngineLoop(
            self.engine, args.max_queue_len, model_name=args.model_name, engine_label=str(self.replica.rank)
        )
        self.info_value = EngineInfo(
            model_name=args.model_name,
            max_model_len=self.engine.max_model_len,
            max_prompt_tokens=self.engine.max_prompt_tokens,
            vocab_size=self.engine.logit_vocab_size,
            device=device,
            dtype=dtype,
            quantization=self.engine.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )

    def _build_engine(self, model_source: str, config: EngineConfig, draft_ahead: bool) -> Engine:
        """Load, build and warm up (after the proposer attached, so that verify steps warm up too).
        Serve reports the app RUNNING only once the constructor returns, so ready means nothing
        compiles while serving. draft_ahead: the proposer actor drafts while this engine verifies, so
        its drafts cost about nothing here."""
        started = time.perf_counter()
        model = load_model(model_source, config.torch_dtype(), config.torch_device(), config.quantization)
        loaded = time.perf_counter()
        if self.proposer is None:  # with proposer_in_process, the proposer is built here
            engine = build_engine(model, config)
        else:
            cost = VERIFY_COST_PER_DRAFT if draft_ahead else draft_cost(config, model.spec.num_layers)
            engine = Engine(model, config, self.proposer, cost)
        built = time.perf_counter()
        if self.proposer is not None and not self.proposer.wait_attached(ATTACH_AT_START_S):
            logger.warning("the proposer has not attached yet; decoding without drafts until it does")
        warm_up_s = engine.warm_up()
        logger.info(
            "model loaded in %.1f s; engine built in %.1f s (CUDA graphs captured); warmed up in %.1f s",
            loaded - started, built - loaded, warm_up_s,
        )  # fmt: skip
        return engine

    def info(self) -> EngineInfo:
        return self.info_value

    def _check_replica(self, replica_id: str | None) -> None:
        if replica_id is not None and replica_id != self.replica.replica_id:
            raise WrongReplicaError(
                f"engine replica {replica_id} is gone (the call reached {self.replica.replica_id})"
            )

    async def submit(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        subscriber_id: str,
        replica_id: str | None = None,
    ) -> list[TileInferError | None]:
        """Queue requests (request_id, prompt_token_ids, params) whose outputs go to the subscriber's
        outputs stream; for each, None or why it was refused (InvalidRequestError, CapacityError). Raises
        UnknownSubscriberError when that stream is not open here (this replica restarted), and
        WrongReplicaError when the call was meant for another replica; then none is queued."""
        self._check_replica(replica_id)
        if any(params.grammar is not None for _, _, params in requests):
            # the engine's check waits for each grammar's compile (engine/sampling/grammar.py, up to 10 s):
            # not on this event loop, which streams every request's outputs
            return await asyncio.to_thread(self._submit, requests, subscriber_id)
        return self._submit(requests, subscriber_id)

    def _submit(
        self, requests: list[tuple[str, list[int], SamplingParams]], subscriber_id: str
    ) -> list[TileInferError | None]:
        refused: list[TileInferError | None] = []
        for request_id, prompt_token_ids, params in requests:
            try:
                self.loop.submit(request_id, prompt_token_ids, params, subscriber_id)
            except UnknownSubscriberError:  # no stream here: none of them is queued
                raise
            except TileInferError as error:
                refused.append(error)
            else:
                refused.append(None)
        return refused

    def abort(self, request_id: str, reason: str = "abort", replica_id: str | None = None) -> None:
        """Stop a request: its client went away, or ("stop") its ingress found a stop string."""
        self._check_replica(replica_id)
        self.loop.abort(request_id, reason)

    async def outputs(
        self, subscriber_id: str, replica_id: str | None = None
    ) -> AsyncIterator[str | list[Delta]]:
        """The subscriber's outputs: this replica's id first (the subscription is open; submit may
        follow), then one list of Delta per item, every step's lists that are ready, joined. Ends when
        the caller cancels it or its heartbeats stop, which aborts the subscriber's requests."""
        self._check_replica(replica_id)
        queue = self.loop.subscribe(subscriber_id)
        watchdog = asyncio.get_running_loop().create_task(self._watch(subscriber_id, queue))
        try:
            yield self.replica.replica_id
            while True:
                ready = await queue.get()
                while ready is not None and not queue.empty():
                    more = queue.get_nowait()
                    if more is None:
                        ready = None
                    else:
                        ready += more
                if ready is None:  # the watchdog: no heartbeat
                    logger.warning(
                        "subscriber %s sent no heartbeat for %.0f s", subscriber_id, SUBSCRIBER_LEASE_S
                    )
                    return
                yield ready
        finally:
            watchdog.cancel()
            self.loop.unsubscribe(subscriber_id, queue)

    def heartbeat(
        self, subscriber_id: str, replica_id: str | None = None, decisions: dict[str, int] | None = None
    ) -> None:
        """The subscriber still reads its stream; decisions: its ingress's routing counts so far, which
        this replica's metrics pass on, so that any ingress can show every ingress's."""
        self._check_replica(replica_id)
        self.loop.heartbeat(subscriber_id)
        if decisions is not None:
            self.routing_decisions[subscriber_id] = decisions

    async def _watch(self, subscriber_id: str, queue: asyncio.Queue) -> None:
        """Ends the subscriber's stream (a None on its queue) once its heartbeats stop."""
        while not self.loop.lapsed(subscriber_id, SUBSCRIBER_LEASE_S):
            await asyncio.sleep(HEARTBEAT_S)
        queue.put_nowait(None)

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the ingress's routers (deployments/replicas/routing.py): the keys of the blocks
        this replica's prefix cache holds, as 8-byte little-endian keys, newest last."""
        # list() is one C call, so the engine thread cannot change the dict under it
        return {"cached_blocks": cached_block_keys(list(self.engine.block_manager.hash_to_block))}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaler sees (deployments/replicas/autoscaling.py): sequences running and
        waiting."""
        scheduler = self.engine.scheduler
        return {SEQUENCES_METRIC: float(len(scheduler.running) + len(scheduler.waiting))}

    def status(self, replica_id: str | None = None) -> dict[str, Any]:
        """This replica's state for /health; raises when its engine thread has stopped."""
        self._check_replica(replica_id)
        self.check_health()
        scheduler = self.engine.scheduler
        return {
            "replica": self.replica.replica_id,
            "engine": str(self.replica.rank),
            "node": self.replica.node_id,
            "state": "ready",
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
        }

    def metrics(self, replica_id: str | None = None) -> tuple[list[Metric], dict[str, dict[str, int]]]:
        """This replica's metric families, labelled engine="<rank>" (deployments/replicas/metrics.py), and the
        routing counts of the ingress replicas that read its outputs (by subscriber)."""
        self._check_replica(replica_id)
        speculator = self.engine.speculator
        stats, step_cost = (speculator.stats, speculator.step_cost) if speculator else (None, 1.0)
        rows_in_gpu_memory = self.proposer is not None and self.proposer.rows_in_gpu_memory
        subscribers = self.loop.subscriber_ids()  # ingress replicas gone since drop out
        decisions = self.routing_decisions
        self.routing_decisions = {key: counts for key, counts in decisions.items() if key in subscribers}
        return self.loop.metric_families(stats, step_cost, rows_in_gpu_memory), self.routing_decisions

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        proposer = getattr(self, "proposer", None)
        if proposer is not None:
            proposer.close()


def start_proposer(
    options: dict[str, Any], name: str, args: AppArgs, device: str, dtype: str, draft_ahead: bool
) -> ActorHandle:
    """This engine replica's proposer actor (named `name`), on its node: in the second bundle of the
    replica's placement group when Serve reserved one for the pair (build_app: engine_bundles), else
    pinned to this node. Ray restarts it when its process dies; it dies with this replica, its owner."""
    group = ray.util.get_current_placement_group()
    if group is not None:
        strategy: Any = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1)
    else:
        strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(ProposerActor).options(
        name=name, max_restarts=-1, scheduling_strategy=strategy, **options
    )
    return actor.remote(args, device, dtype, draft_ahead)


def _this_replica() -> EngineReplica:
    """This engine replica's identity, from Serve's replica context (outside Serve: a lone replica)."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return EngineReplica("local", 0, "")
    rank = getattr(context, "rank", None)
    node_id = ray.get_runtime_context().get_node_id()
    return EngineReplica(
        context.replica_id.unique_id, rank.rank if rank is not None else 0, node_id, context.app_name
    )
