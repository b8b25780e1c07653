"""The draft ring: where a proposer in another process writes a step's drafts and the engine's verify step
reads them, with no host wait between the two on a GPU.

One int64 vector, [lengths[max_requests], drafts[max_requests, max_drafts]], and a flag: row r of a step
holds the drafts of the step's r-th request. The proposer writes the lengths and drafts, then sets the
flag to the step's number. The flag is a word of the channel's shared host memory, registered with CUDA
on both sides (proposers/stream_signal.py). On a GPU the engine allocates the vector and the proposer
maps it (proposers/cuda_ipc.py); the proposer's stream writes the flag after its copies, and the
engine's stream waits for the flag before it gathers the drafts into the step's input ids, so the
engine's host launches the verify step while the proposer still drafts. Elsewhere (a CPU, or a proposer
that cannot map the engine's GPU) the vector is in the channel's shared host memory too, and the
engine's host waits for the flag before it gathers.

The host reads back the drafts the step used (and their lengths) with its results. Verification only
needs to know which drafts it checked, so whatever the ring held is exact: a proposer that never sets
the flag is waited for until a deadline, then the engine sets the flag itself and verifies what is
there: a host store, which needs no CUDA call (a second stream of the engine's own could be queued
behind the waiting one). A watchdog thread makes that store at the deadline, so that it does not depend
on the engine's thread, which a CUDA call queued behind the wait may block (a kernel's first launch loads
it, and loading may synchronize the context).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tileinfer.proposers.stream_signal import wait_at_least, write_after

POLL_SLEEP_S = 20e-6  # the engine's host, between looks at the flag or the step's event


class _Watchdog:
    """One daemon thread that calls each armed function at its deadline, unless it was disarmed first. It
    wakes for the earliest deadline armed, not for each arming: a waking thread takes the GIL from the
    engine's."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._armed: list[tuple[float, int, Callable[[], None]]] = []  # a heap by deadline
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, call: Callable[[], None]) -> int:
        """Call `call` at time.monotonic() `deadline` (on the watchdog's thread); returns its number."""
        with self._condition:
            number = next(self._numbers)
            heapq.heappush(self._armed, (deadline, number, call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tileinfer-ring-deadline", daemon=True)
                self._thread.start()
            elif self._armed[0][1] == number:  # earlier than the one the thread sleeps for
                self._condition.notify()
            return number

    def disarm(self, number: int) -> None:
        with self._condition:
            self._armed = [entry for entry in self._armed if entry[1] != number]
            heapq.heapify(self._armed)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._armed or self._armed[0][0] > time.monotonic():
                    self._condition.wait(self._armed[0][0] - time.monotonic() if self._armed else None)
                _, _, call = heapq.heappop(self._armed)
            call()


_WATCHDOG = _Watchdog()


class DraftRing:
    """Views of a ring vector (`storage`, int64, on a GPU or in host memory) for max_requests rows of
    max_drafts drafts, and its flag: `flag`, a one-word int64 view of shared host memory, whose device
    address in this process is flag_address (a GPU ring only)."""

    def __init__(
        self,
        storage: torch.Tensor,
        max_requests: int,
        max_drafts: int,
        flag: np.ndarray,
        flag_address: int | None = None,
    ) -> None:
        assert storage.dtype == torch.int64 and storage.numel() == self.size(max_requests, max_drafts)
        assert flag_address is not None or storage.device.type == "cpu"
        self.storage = storage
        self.max_requests, self.max_drafts = max_requests, max_drafts
        self.flag, self.flag_address = flag, flag_address
        self.lengths = storage[:max_requests]
        self.drafts = storage[max_requests:].view(max_requests, max_drafts)
        self._staging: torch.Tensor | None = None  # pinned: a GPU ring's writes come from here

    @staticmethod
    def size(max_requests: int, max_drafts: int) -> int:
        return max_requests + max_requests * max_drafts

    @property
    def on_gpu(self) -> bool:
        return self.storage.device.type == "cuda"

    def publish(self, drafts: Sequence[Sequence[int]], step: int) -> None:
        """The proposer's end: write row r's drafts, then the flag `step`. On a GPU both go on the
        current stream and this returns at once (the pinned staging is reused only by the next step,
        which comes after the engine saw this flag)."""
        count = len(drafts)
        if not self.on_gpu:
            for row, proposal in enumerate(drafts):
                self.drafts[row, : len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
                self.lengths[row] = len(proposal)
            self.flag[0] = step  # last (x86 keeps the stores in order)
            return
        if self._staging is None:
            self._staging = torch.zeros(self.storage.numel(), dtype=torch.int64).pin_memory()
        lengths = self._staging[: self.max_requests]
        rows = self._staging[self.max_requests :].view(self.max_requests, self.max_drafts)
        for row, proposal in enumerate(drafts):
            rows[row, : len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
            lengths[row] = len(proposal)
        self.lengths[:count].copy_(lengths[:count], non_blocking=True)
        self.drafts[:count].copy_(rows[:count], non_blocking=True)
        write_after(self.flag_address, step, torch.cuda.current_stream(self.storage.device))

    def signalled(self, step: int) -> bool:
        return int(self.flag[0]) >= step

    def release(self, step: int) -> None:
        """The engine's end, for a proposer that did not answer `step`: set the flag itself."""
        self.flag[0] = max(int(self.flag[0]), step)


@dataclasses.dataclass
class RingDrafts:
    """A step whose drafts come through the ring (RemoteProposer.launch): request i's drafts, up to
    num_drafts[i], are in ring row rows[i] (None: it asked for none) once the flag reaches `step`. The
    engine's DeviceDrafts (engine/spec_decode/proposer_interface.py)."""

    ring: DraftRing
    step: int
    rows: list[int | None]
    num_drafts: list[int]
    timeout_s: float  # from the launch
    on_timeout: Callable[[], None]  # the proposer did not answer in time: give up on its channel
    launched_at: float = dataclasses.field(default_factory=time.monotonic)
    timed_out: bool = False  # set by RingRead.finish
    waited_s: float = 0.0  # set by RingRead: how long the engine's host waited for the drafts

    @property
    def deadline(self) -> float:
        return self.launched_at + self.timeout_s

    def read(self, token_rows: list[int], slots: list[tuple[int, int]], device: torch.device) -> RingRead:
        return RingRead(self, token_rows, slots, device)


class RingRead:
    """One verify step's read of a RingDrafts: the packed input ids at token_rows take the drafts of
    ring row ring_rows[i], draft j, per draft slot.

    gather_into(ids) before the forward pass; finish() after it, for the drafts the step used and how
    many of each row are real. Order matters on a GPU: every host-to-device copy of the step comes
    before the stream's wait, since a copy queued behind the wait could block the host."""

    def __init__(
        self, launch: RingDrafts, token_rows: list[int], slots: list[tuple[int, int]], device: torch.device
    ) -> None:
        """token_rows[i] (of ids on `device`) takes draft slots[i] = (ring row, draft index). The index
        tensors cross to the devices here, before the step's work is queued."""
        self.launch = launch
        ring = launch.ring
        self.token_rows = token_rows
        self.ring_rows = sorted({row for row, _ in slots})
        pinned = device.type == "cuda"
        flat_slots = [row * ring.max_drafts + j for row, j in slots]
        host = tuple(
            torch.tensor(values, dtype=torch.int64, pin_memory=pinned)
            for values in (token_rows, flat_slots, self.ring_rows)
        )
        self._host = host  # pinned sources must outlive their copies
        self._token_rows = host[0].to(device, non_blocking=True)
        self._slots = host[1].to(ring.storage.device, non_blocking=True)
        self._rows = host[2].to(ring.storage.device, non_blocking=True)
        self._taken: torch.cuda.Event | None = None
        self._deadline_call: int | None = None  # the watchdog's, on a GPU ring
        self._ids: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None
        self.timed_out = False

    def gather_into(self, ids: torch.Tensor) -> None:
        """Fill ids[token_rows] from the ring once the proposer answered (on a GPU ring: on the stream)."""
        ring, launch = self.launch.ring, self.launch
        self._ids = ids
        if ring.on_gpu:
            self._deadline_call = _WATCHDOG.arm(launch.deadline, self._give_up)
            wait_at_least(ring.flag_address, launch.step, torch.cuda.current_stream(ids.device))
        else:
            started = time.monotonic()
            while not ring.signalled(launch.step):
                if time.monotonic() > launch.deadline:
                    self.timed_out = True
                    self._lengths = torch.zeros(len(self.ring_rows), dtype=torch.int64)
                    break  # the ids keep what the runner put there; no drafts count
                time.sleep(POLL_SLEEP_S)
            launch.waited_s = time.monotonic() - started
            if self.timed_out:
                return
        ids[self._token_rows] = ring.drafts.view(-1)[self._slots].to(ids.device)
        self._lengths = ring.lengths[self._rows].clone()
        if ring.on_gpu:
            self._taken = torch.cuda.Event()
            self._taken.record()

    def _give_up(self) -> None:
        """At the deadline (on the watchdog's thread, or in finish): release the ring unless the proposer
        has answered. A host store, no CUDA call."""
        if not self.launch.ring.signalled(self.launch.step):
            self.timed_out = True
            self.launch.ring.release(self.launch.step)

    def finish(self) -> tuple[list[int], dict[int, int]]:
        """The ids the step used at token_rows, and each ring row's number of drafts; waits (on a GPU
        ring) for the gather until the deadline, then releases the ring (timed_out: give up on the
        proposer). Call once the forward pass is queued."""
        if self._taken is not None:
            started = time.monotonic()
            while not self._taken.query():
                if time.monotonic() > self.launch.deadline:
                    self._give_up()
                    self._taken.synchronize()
                    break
                time.sleep(POLL_SLEEP_S)
            _WATCHDOG.disarm(self._deadline_call)
            self.launch.waited_s = time.monotonic() - started
        if self.timed_out:
            self.launch.timed_out = True
            self.launch.on_timeout()
        used = self._ids[self._token_rows].tolist()
        return used, dict(zip(self.ring_rows, self._lengths.tolist(), strict=True))
