"""Which engine replica a request goes to: the one most likely to hold its prompt's prefix in its KV
cache, unless the load is uneven (README, Scaling out).

The ingress already tokenizes, so it keys each prompt by the chained hashes of its full KV blocks, the
same hashes the engine's block manager registers for prefix reuse (engine/kv/block_manager.py). A replica
holds a prompt's first n blocks when

- this ingress replica sent it a prompt with those blocks (remembered here, least recently used first
  out), or
- the replica itself reported them: every engine replica reports its registered block hashes through
  Serve's routing stats (EngineDeployment.record_routing_stats, every ROUTING_STATS_PERIOD_S), so
  every ingress replica learns what the others sent, as Dynamo's workers report their cached blocks.

The policy is sglang-gateway's and vllm-router's `cache_aware`, with their anchors: when the busiest
replica has more than `balance_abs_threshold` requests above the idlest and more than
`balance_rel_threshold` times as many, the least loaded replica takes the request ("load_fallback").
Otherwise the replica with the longest cached prefix takes it when that prefix is at least
`affinity_threshold` of the prompt's blocks ("affinity"), else the least loaded one ("least_loaded").
Without prefix_aware (engine_router: power_of_two), the less loaded of two replicas drawn at random
takes it, Serve's default policy ("power_of_two"): the baseline that knows nothing of caches.
A replica's load is the requests this ingress replica has in flight there, times the number of
ingress replicas: Serve spreads clients evenly over those, and the count is exact and immediate,
where the engines' own counts reach the ingress only with the routing stats.

Serve's request-router API carries it out (deployments/replicas/engine_router.py): a call that names a replica
(ROUTE_KWARG) goes to that replica; any other call is routed by power of two choices, as Serve's
default. Serve constructs the router inside its handle, so the router and the ingress's EngineClient
meet in one RoutingPolicy per deployment and process (policy_for).
"""

from __future__ import annotations

import collections
import random
import struct
import threading
from collections.abc import Collection, Sequence
from typing import Any

from tileinfer.engine.kv.block_manager import chained_block_hashes

# The keyword argument that pins a call to one engine replica (its Serve replica id); the engine
# method takes it too and refuses a call that reached another replica.
ROUTE_KWARG = "replica_id"
ROUTING_STATS_PERIOD_S = 1.0  # how often each engine replica reports its load and cached blocks
# the most recently registered blocks an engine replica reports (16 tokens each): the report costs its
# process about 3 ms of Python a second beside the engine thread
MAX_REPORTED_BLOCKS = 1 << 14
MAX_REMEMBERED_BLOCKS = 1 << 18  # blocks this ingress replica remembers having sent somewhere
DECISIONS = ("affinity", "load_fallback", "least_loaded", "power_of_two", "retry")


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The prompt's full blocks as 8-byte keys of their chained hashes: the keys engines report."""
    return [int.from_bytes(digest[:8], "little") for digest in chained_block_hashes(token_ids, block_size)]


def cached_block_keys(hashes: Collection[bytes]) -> bytes:
    """What an engine replica reports of its registered block hashes, the newest last: their keys packed
    as 8-byte little-endian integers (a key is a digest's first 8 bytes, read so)."""
    return b"".join(digest[:8] for digest in list(hashes)[-MAX_REPORTED_BLOCKS:])


class RoutingPolicy:
    """The choice of an engine replica for each request, and the state it needs; thread-safe (Serve's
    router may run on its own event loop's thread, the ingress's requests on another)."""

    def __init__(
        self,
        *,
        prefix_aware: bool = True,
        num_ingress_replicas: int = 1,
        affinity_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.prefix_aware = prefix_aware
        self.num_ingress_replicas = num_ingress_replicas
        self.affinity_threshold = affinity_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.decisions: collections.Counter[str] = collections.Counter({name: 0 for name in DECISIONS})
        self._lock = threading.Lock()
        self._replicas: dict[str, frozenset[int]] = {}  # replica id -> the block keys it reported
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._sent: collections.OrderedDict[int, str] = collections.OrderedDict()  # block key -> replica

    def configure(self, **settings: Any) -> None:
        """Set the policy's settings (the ingress does, once it knows the app's args)."""
        with self._lock:
            for name, value in settings.items():
                if not hasattr(self, name):
                    raise AttributeError(f"RoutingPolicy has no setting {name!r}")
                setattr(self, name, value)

    # --- Serve's view of the replicas (from the router) -------------------------------------------

    def set_replicas(self, reports: dict[str, dict[str, Any]]) -> None:
        """The running replicas, each with its latest routing stats (empty before its first report)."""
        replicas = {}
        for replica_id, stats in reports.items():
            packed = stats.get("cached_blocks", b"")
            replicas[replica_id] = frozenset(struct.unpack(f"<{len(packed) // 8}Q", packed))
        with self._lock:
            self._replicas = replicas

    def forget(self, replica_id: str) -> None:
        """The replica died: route nothing more to it (Serve's next update agrees)."""
        with self._lock:
            self._replicas.pop(replica_id, None)

    def uses_prefixes(self) -> bool:
        """Whether prompts' block keys can change a choice: prefix-aware, with replicas to choose from."""
        return self.prefix_aware and len(self._replicas) > 1

    def replica_ids(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    # --- choosing ------------------------------------------------------------------------------

    def choose(self, keys: Sequence[int], exclude: Collection[str] = (), retry: bool = False) -> str | None:
        """The replica for a prompt with these block keys, counted as in flight there; None when no
        replica is known (then Serve routes the call). exclude: replicas that just failed it."""
        with self._lock:
            candidates = [replica for replica in self._replicas if replica not in exclude]
            if not candidates:
                return None
            load = {replica: self._in_flight[replica] * self.num_ingress_replicas for replica in candidates}
            if not self.prefix_aware:  # Serve's default policy, on this ingress's counts: the baseline
                pair = random.sample(candidates, min(2, len(candidates)))
                chosen = min(pair, key=load.__getitem__)
                self.decisions["retry" if retry else "power_of_two"] += 1
                self._in_flight[chosen] += 1
                return chosen
            least_loaded = min(load.values())
            idlest = [replica for replica in candidates if load[replica] == least_loaded]
            chosen, decision = random.choice(idlest), "least_loaded"
            busiest = max(load.values())
            balanced = not (
                busiest - least_loaded > self.balance_abs_threshold
                and busiest > self.balance_rel_threshold * least_loaded
            )
            if not balanced:
                decision = "load_fallback"
            elif keys:
                cached = {replica: self._cached_prefix(replica, keys) for replica in candidates}
                best = max(cached.values())
                if best >= self.affinity_threshold * len(keys) and best > 0:
                    favoured = [replica for replica in candidates if cached[replica] == best]
                    chosen = min(favoured, key=load.__getitem__)
                    decision = "affinity"
            self.decisions["retry" if retry else decision] += 1
            self._in_flight[chosen] += 1
            self._remember(keys, chosen)
            return chosen

    def finished(self, replica_id: str) -> None:
        """A request chosen for the replica ended there (or never got there)."""
        with self._lock:
            if self._in_flight[replica_id] > 0:
                self._in_flight[replica_id] -= 1

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return {replica: count for replica, count in self._in_flight.items() if count}

    def _cached_prefix(self, replica: str, keys: Sequence[int]) -> int:
        """How many of the prompt's first blocks the replica holds, as far as this ingress knows."""
        reported = self._replicas[replica]
        count = 0
        for key in keys:
            if self._sent.get(key) != replica and key not in reported:
                break
            count += 1
        return count

    def _remember(self, keys: Sequence[int], replica: str) -> None:
        sent = self._sent
        for key in keys:
            sent[key] = replica
            sent.move_to_end(key)
        while len(sent) > MAX_REMEMBERED_BLOCKS:
            sent.popitem(last=False)


_POLICIES: dict[tuple[str, str], RoutingPolicy] = {}
_POLICIES_LOCK = threading.Lock()


def policy_for(app_name: str, deployment_name: str) -> RoutingPolicy:
    """This process's routing policy for a deployment, shared by its router and its EngineClient."""
    with _POLICIES_LOCK:
        return _POLICIES.setdefault((app_name, deployment_name), RoutingPolicy())
