"""A shared-memory channel between the engine and a proposer in another process: one request and one
response per step, signalled by sequence counters, with no Ray call and no pickling per step.

The engine side (ChannelClient) creates and owns the segment; the proposer side (ChannelServer) attaches
by name. The layout is fixed at creation from ChannelCapacity, which the header records, so the server
derives the same layout:

    header     int64[len(HEADER)]                  counters, sizes of the current step, capacities
    request    keys, keep, num_new, num_drafts,    int64[max_requests] each
               num_rows, row_starts
               forget_keys                         int64[max_forgets]
               hidden                              hidden_dtype[max_step_rows, hidden_width]
               new_tokens                          int32[max_step_tokens]  (each request's, in order)
    response   draft_lengths                       int64[max_requests]
               drafts                              int32[max_requests, max_drafts]
               error                               uint8[ERROR_BYTES]      (utf-8, when status is 1)
    device     description                         uint8[DESCRIPTOR_BYTES] (with hidden rows only)
    ring       ring_description                    uint8[DESCRIPTOR_BYTES] (the engine's GPU ring)
               ring                                int64[DraftRing.size(max_requests, max_drafts)]

A request names a sequence by a small integer key and says how many of the tokens the server mirrors to
KEEP and which NEW tokens follow, so only the tokens accepted since the last step cross. For DFlash a
request also carries NUM_ROWS new rows of the target's hidden states (rows, like tokens, cross once); a
channel without a hidden width has no hidden area. A client on a GPU also offers the rows in GPU memory
(proposers/device_rows.py: CUDA IPC, described in the device area); a server that can map it sets
device_attached, and from then on the rows cross there, while the header keeps the signalling. Tokens
cross in host memory: both sides need them on the host.

Drafts made by a model on the proposer's GPU (ring_drafts, set by the server) can cross in a draft ring
instead (proposers/draft_ring.py): a step sent with to_ring is answered in the ring, which the engine's
verify step reads without the engine's host waiting for the answer. A client on a GPU offers a ring in its
GPU memory (ring_description); a server that maps it sets ring_attached to RING_ON_GPU, else it answers in
the segment's host ring (RING_IN_HOST). Either way the ring's flag is the header's ring_flag: the
header's page is registered with CUDA on both sides of a GPU ring (proposers/stream_signal.py).

Signalling: the client writes a request, then bumps request_seq; the server polls request_seq (spinning
briefly, then sleeping a little), answers, then sets response_seq to it; the client waits for that with a
deadline (for a step answered in the ring: before it sends the next step). Stores are ordered on x86
(TSO), which is what this relies on between the writes and the bump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np
import torch
from tileinfer.proposers.cuda_ipc import describe, open_described
from tileinfer.proposers.device_rows import DeviceRowsExport, DeviceRowsImport
from tileinfer.proposers.draft_ring import DraftRing
from tileinfer.proposers.stream_signal import map_host_page, unmap_host_page

MAGIC = 0x54494C4543484E33  # "TILECHN3": the segment is a channel of this layout
HEADER = (
    "magic", "request_seq", "response_seq", "closed", "num_requests", "num_new_tokens", "num_forgets",
    "status", "num_step_rows", "max_requests", "max_step_tokens", "max_drafts", "max_forgets",
    "max_step_rows", "hidden_width", "hidden_dtype", "device_rows", "device_attached", "step_rows_on_device",
    "ring_on_gpu", "ring_attached", "ring_drafts", "step_to_ring", "ring_flag",
)  # fmt: skip
_FIELD = {name: index for index, name in enumerate(HEADER)}
ERROR_BYTES = 1024
DESCRIPTOR_BYTES = 4096  # room for a GPU buffer's JSON description (proposers/cuda_ipc.py)
RING_ON_GPU, RING_IN_HOST = 1, 2  # ring_attached: which ring the server answers in
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux
STATUS_OK, STATUS_ERROR = 0, 1
HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_CODES = {name: code for code, name in enumerate(HIDDEN_DTYPES)}  # as the header records it

# Waiting sides poll the counters in a busy loop for SPIN_S first: even time.sleep(0) costs ~100 us of
# wake-up on a loaded host, more than the whole hand-off.
SPIN_S = 200e-6
POLL_SLEEP_S = 50e-6  # then sleep this long between polls
IDLE_AFTER_S = 1.0  # a server with no step for this long...
IDLE_SLEEP_S = 1e-3  # ...polls this rarely (the first step after a pause waits up to this much longer)


class ChannelCapacityError(ValueError):
    """A step that does not fit the channel's fixed capacity."""


class ChannelClosedError(RuntimeError):
    """The other side closed the channel."""


class RemoteProposerError(RuntimeError):
    """The proposer raised while serving a step; its message crossed the channel."""


@dataclasses.dataclass(frozen=True)
class ChannelCapacity:
    max_requests: int = 256  # sequences per step
    max_step_tokens: int = 1 << 20  # new tokens per step, all sequences together (a new prompt crosses once)
    max_drafts: int = 16  # drafts per sequence
    max_forgets: int = 1024  # forgotten keys per step
    # DFlash: the target's hidden-state rows per step, all sequences together, and their width and dtype
    # (fixed for the channel); a hidden_width of 0 means no rows cross
    max_step_rows: int = 0
    hidden_width: int = 0
    hidden_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_step_tokens", "max_drafts", "max_forgets"):
            if getattr(self, name) < 1:
                raise ValueError(f"channel capacity {name} must be at least 1")
        if self.hidden_width < 0 or self.max_step_rows < (1 if self.hidden_width else 0):
            raise ValueError("a channel with a hidden width needs max_step_rows of at least 1")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(
                f"hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.hidden_dtype}"
            )

    @property
    def hidden_rows(self) -> int:
        """Rows the hidden area holds (none without a width)."""
        return self.max_step_rows if self.hidden_width else 0

    def header_values(self) -> dict[str, int]:
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return values | {"hidden_dtype": _DTYPE_CODES[self.hidden_dtype]}

    @classmethod
    def from_header(cls, header: np.ndarray) -> ChannelCapacity:
        values = {field.name: int(header[_FIELD[field.name]]) for field in dataclasses.fields(cls)}
        return cls(**values | {"hidden_dtype": list(HIDDEN_DTYPES)[values["hidden_dtype"]]})


@dataclasses.dataclass(frozen=True)
class ChannelRequest:
    """One sequence in a step: keep `keep` mirrored tokens, append `new_tokens`, draft `num_drafts`;
    `hidden` ([num_rows, hidden_width]) are new rows of the target's hidden states, for DFlash, the
    first of them at position `row_start`."""

    key: int
    keep: int
    new_tokens: Sequence[int]
    num_drafts: int
    hidden: torch.Tensor | None = None
    row_start: int = 0

    @property
    def num_rows(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]


@dataclasses.dataclass(frozen=True)
class ChannelStep:
    """A step as the server reads it (copies: the client may write the next step after the answer)."""

    requests: list[ChannelRequest]
    forget_keys: list[int]


class _Layout:
    """Numpy views of every area of a channel segment."""

    def __init__(self, buffer: memoryview | mmap.mmap, capacity: ChannelCapacity) -> None:
        offset = 0

        def take(dtype: type, shape: int | tuple[int, ...]) -> np.ndarray:
            nonlocal offset
            array = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            offset += array.nbytes
            return array

        self.header = take(np.int64, len(HEADER))
        self.keys = take(np.int64, capacity.max_requests)
        self.keep = take(np.int64, capacity.max_requests)
        self.num_new = take(np.int64, capacity.max_requests)
        self.num_drafts = take(np.int64, capacity.max_requests)
        self.num_rows = take(np.int64, capacity.max_requests)
        self.row_starts = take(np.int64, capacity.max_requests)
        self.forget_keys = take(np.int64, capacity.max_forgets)
        self.draft_lengths = take(np.int64, capacity.max_requests)
        self.hidden: torch.Tensor | None = None  # [hidden_rows, hidden_width]
        self.description = take(np.uint8, DESCRIPTOR_BYTES if capacity.hidden_rows else 0)
        self.ring_description = take(np.uint8, DESCRIPTOR_BYTES)
        ring_size = DraftRing.size(capacity.max_requests, capacity.max_drafts)
        self.ring = DraftRing(
            torch.frombuffer(buffer, dtype=torch.int64, count=ring_size, offset=offset),
            capacity.max_requests, capacity.max_drafts, self.header[_FIELD["ring_flag"] :][:1],
        )  # fmt: skip
        offset += 8 * ring_size
        if capacity.hidden_rows:
            dtype = HIDDEN_DTYPES[capacity.hidden_dtype]
            count = capacity.hidden_rows * capacity.hidden_width
            self.hidden = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
            self.hidden = self.hidden.view(capacity.hidden_rows, capacity.hidden_width)
            offset += count * dtype.itemsize
        self.new_tokens = take(np.int32, capacity.max_step_tokens)
        self.drafts = take(np.int32, (capacity.max_requests, capacity.max_drafts))
        self.error = take(np.uint8, ERROR_BYTES)
        self.nbytes = offset

    @classmethod
    def size(cls, capacity: ChannelCapacity) -> int:
        int64s = len(HEADER) + 7 * capacity.max_requests + capacity.max_forgets  # 7 per-request arrays
        int32s = capacity.max_step_tokens + capacity.max_requests * capacity.max_drafts
        row_bytes = capacity.hidden_width * HIDDEN_DTYPES[capacity.hidden_dtype].itemsize
        int64s += DraftRing.size(capacity.max_requests, capacity.max_drafts)
        descriptions = DESCRIPTOR_BYTES * (2 if capacity.hidden_rows else 1)
        return 8 * int64s + descriptions + capacity.hidden_rows * row_bytes + 4 * int32s + ERROR_BYTES

    def get(self, field: str) -> int:
        return int(self.header[_FIELD[field]])

    def set(self, field: str, value: int) -> None:
        self.header[_FIELD[field]] = value


class ChannelClient:
    """The engine's end: creates the segment, writes steps and waits for their drafts."""

    def __init__(self, capacity: ChannelCapacity | None = None, device: torch.device | None = None) -> None:
        """device: where the hidden rows are (a GPU: they are offered in GPU memory too)."""
        self.capacity = capacity or ChannelCapacity()
        self._shm = shared_memory.SharedMemory(
            name=f"tileinfer-{uuid.uuid4().hex[:16]}", create=True, size=_Layout.size(self.capacity)
        )
        self.name = self._shm.name
        self._layout = _Layout(self._shm.buf, self.capacity)
        self._layout.header[:] = 0
        for field, value in self.capacity.header_values().items():
            self._layout.set(field, value)
        self._device_rows: DeviceRowsExport | None = None
        if device is not None and device.type == "cuda" and self.capacity.hidden_rows:
            self._device_rows = DeviceRowsExport(
                self.capacity.hidden_rows, self.capacity.hidden_width,
                HIDDEN_DTYPES[self.capacity.hidden_dtype], device,
            )  # fmt: skip
            _write_description(self._layout.description, self._device_rows.descriptor())
            self._layout.set("device_rows", 1)
        self._gpu_ring: DraftRing | None = None
        if device is not None and device.type == "cuda":
            storage = torch.zeros(
                DraftRing.size(self.capacity.max_requests, self.capacity.max_drafts), dtype=torch.int64,
                device=device,
            )  # fmt: skip
            self._gpu_ring = _gpu_ring(self._layout, storage)
            if self._gpu_ring is not None:
                _write_description(self._layout.ring_description, describe(storage))
                self._layout.set("ring_on_gpu", 1)
        self._layout.set("magic", MAGIC)  # last: a server that sees it sees the capacities too
        self._seq = 0

    @property
    def rows_in_gpu_memory(self) -> bool:
        """Whether hidden rows cross in GPU memory: offered here, and mapped by the server."""
        return self._device_rows is not None and bool(self._layout.get("device_attached"))

    @property
    def ring(self) -> DraftRing | None:
        """The ring the server answers to_ring steps in, once it attached and wants to (ring_drafts)."""
        layout = self._layout
        if not layout.get("ring_drafts"):
            return None
        attached = layout.get("ring_attached")
        if attached == RING_ON_GPU and self._gpu_ring is not None:
            return self._gpu_ring
        return layout.ring if attached == RING_IN_HOST else None

    def receive(self, timeout_s: float) -> list[list[int]]:
        """Wait up to timeout_s for the drafts of the step just sent (not to the ring), one list per request
        (TimeoutError and RemoteProposerError as for send)."""
        self._await_answer(self._seq, timeout_s)
        layout = self._layout
        lengths = layout.draft_lengths[: layout.get("num_requests")].tolist()
        return [layout.drafts[index, :length].tolist() for index, length in enumerate(lengths)]

    @property
    def last_step(self) -> int:
        """The number of the step sent last."""
        return self._seq

    def send(
        self,
        requests: Sequence[ChannelRequest],
        forget_keys: Sequence[int],
        timeout_s: float,
        to_ring: bool = False,
    ) -> int:
        """Send one step without waiting for its answer; returns its number. to_ring: answered in the
        ring (self.ring) rather than here. Waits first (up to timeout_s) for the last step's answer.
        Raises ChannelCapacityError for a step that does not fit, TimeoutError when no answer comes within
        timeout_s (the server is dead or stalled: the channel must then be abandoned) and
        RemoteProposerError when the proposer raised."""
        self._check_fits(requests, forget_keys)
        layout = self._layout
        if layout.get("closed"):
            raise ChannelClosedError(f"channel {self.name} is closed")
        self._await_answer(self._seq, timeout_s)
        offset = row_offset = 0
        device_rows = self._device_rows if layout.get("device_attached") else None
        for index, request in enumerate(requests):
            layout.keys[index] = request.key
            layout.keep[index] = request.keep
            layout.num_new[index] = len(request.new_tokens)
            layout.num_drafts[index] = request.num_drafts
            layout.num_rows[index] = request.num_rows
            layout.row_starts[index] = request.row_start
            layout.new_tokens[offset : offset + len(request.new_tokens)] = request.new_tokens
            offset += len(request.new_tokens)
            if request.num_rows:  # converted to the channel's dtype as they are copied in
                if device_rows is not None:
                    device_rows.write(row_offset, request.hidden)
                else:
                    layout.hidden[row_offset : row_offset + request.num_rows] = request.hidden
                row_offset += request.num_rows
        if device_rows is not None and row_offset:
            device_rows.publish()
        layout.forget_keys[: len(forget_keys)] = forget_keys
        layout.set("num_requests", len(requests))
        layout.set("num_new_tokens", offset)
        layout.set("num_step_rows", row_offset)
        # where this step's rows are: the server may attach (and map the GPU buffer) between steps
        layout.set("step_rows_on_device", int(device_rows is not None))
        layout.set("num_forgets", len(forget_keys))
        layout.set("step_to_ring", int(to_ring))
        layout.set("status", STATUS_OK)
        self._seq += 1
        layout.set("request_seq", self._seq)  # last: this publishes the step
        return self._seq

    def _await_answer(self, seq: int, timeout_s: float) -> None:
        """Wait up to timeout_s until the server answered step `seq` (raising as send does)."""
        layout = self._layout
        deadline = time.monotonic() + timeout_s
        spin_until = time.monotonic() + SPIN_S
        while layout.get("response_seq") < seq:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the proposer did not answer within {timeout_s:.3f} s")
            if now >= spin_until:
                time.sleep(POLL_SLEEP_S)
        if seq and layout.get("status") == STATUS_ERROR:
            message = bytes(layout.error).rstrip(b"\0").decode("utf-8", "replace")
            layout.set("status", STATUS_OK)  # reported once
            raise RemoteProposerError(f"the proposer failed: {message}")

    def _check_fits(self, requests: Sequence[ChannelRequest], forget_keys: Sequence[int]) -> None:
        capacity = self.capacity
        num_new_tokens = sum(len(request.new_tokens) for request in requests)
        most_drafts = max((request.num_drafts for request in requests), default=0)
        for request in requests:
            if request.num_rows and tuple(request.hidden.shape[1:]) != (capacity.hidden_width,):
                raise ChannelCapacityError(
                    f"hidden rows of shape {list(request.hidden.shape)}; the channel's rows have "
                    f"{capacity.hidden_width} values"
                )
        for what, value, limit in (
            ("sequences", len(requests), capacity.max_requests),
            ("new tokens", num_new_tokens, capacity.max_step_tokens),
            ("drafts per sequence", most_drafts, capacity.max_drafts),
            ("forgotten sequences", len(forget_keys), capacity.max_forgets),
            ("hidden rows", sum(request.num_rows for request in requests), capacity.hidden_rows),
        ):
            if value > limit:
                raise ChannelCapacityError(f"this step has {value} {what}; the channel holds at most {limit}")

    def close(self) -> None:
        """Tell the server to stop and remove the segment (mappings already made stay valid)."""
        if self._shm is None:
            return
        self._layout.set("closed", 1)
        if self._gpu_ring is not None:
            unmap_host_page(self._layout.header.ctypes.data)
            self._gpu_ring = None
        del self._layout  # the views must go before the buffer can be released
        self._shm.unlink()
        with contextlib.suppress(BufferError):  # a view alive on another thread: the mapping goes with it
            self._shm.close()
        self._shm = None


class ChannelServer:
    """The proposer's end: attaches to a client's segment by name, reads steps and answers them."""

    def __init__(self, name: str) -> None:
        self.name = name
        # Mapped from /dev/shm directly, not through SharedMemory, which would register the segment with
        # this process's resource tracker and have it unlinked when this process ends (Python < 3.13).
        with open(os.path.join(SHM_DIR, name), "r+b") as file:  # FileNotFoundError: not on this host
            self._mmap = mmap.mmap(file.fileno(), 0)
        header = np.ndarray(len(HEADER), dtype=np.int64, buffer=self._mmap)
        magic = int(header[_FIELD["magic"]])
        capacity = ChannelCapacity.from_header(header) if magic == MAGIC else None
        del header
        if capacity is None:
            self._mmap.close()
            raise ValueError(f"shared memory {name!r} is not a TileInfer proposer channel")
        self.capacity = capacity
        self._layout = _Layout(self._mmap, self.capacity)
        self._device_rows: DeviceRowsImport | None = None
        if self._layout.get("device_rows"):
            self._device_rows = DeviceRowsImport.open(bytes(self._layout.description).rstrip(b"\0"))
            self._layout.set("device_attached", int(self._device_rows is not None))
        self.ring = self._layout.ring
        if self._layout.get("ring_on_gpu"):
            storage = open_described(bytes(self._layout.ring_description).rstrip(b"\0"))
            if storage is not None:
                self.ring = _gpu_ring(self._layout, storage) or self.ring
        self._layout.set("ring_attached", RING_ON_GPU if self.ring.on_gpu else RING_IN_HOST)
        self._to_ring = False  # whether the step just read is answered in the ring
        self._seq = self._layout.get("response_seq")
        self._last_step_time = time.monotonic()

    def next_step(self, stop: threading.Event) -> ChannelStep | None:
        """Wait for the next step; None once the client closed the channel or `stop` is set."""
        layout = self._layout
        while layout.get("request_seq") <= self._seq and not layout.get("closed") and not stop.is_set():
            idle_s = time.monotonic() - self._last_step_time
            if idle_s >= SPIN_S:
                time.sleep(POLL_SLEEP_S if idle_s < IDLE_AFTER_S else IDLE_SLEEP_S)
        if layout.get("closed") or stop.is_set():
            return None
        self._seq = layout.get("request_seq")
        self._to_ring = bool(layout.get("step_to_ring"))
        self._last_step_time = time.monotonic()
        requests, offset, row_offset = [], 0, 0
        rows_on_device = self._device_rows is not None and bool(layout.get("step_rows_on_device"))
        for index in range(layout.get("num_requests")):
            num_new, num_rows = int(layout.num_new[index]), int(layout.num_rows[index])
            hidden = None
            if num_rows:
                if rows_on_device:
                    hidden = self._device_rows.read(row_offset, num_rows)
                else:
                    hidden = layout.hidden[row_offset : row_offset + num_rows].clone()
                row_offset += num_rows
            requests.append(
                ChannelRequest(
                    key=int(layout.keys[index]),
                    keep=int(layout.keep[index]),
                    new_tokens=layout.new_tokens[offset : offset + num_new].tolist(),
                    num_drafts=int(layout.num_drafts[index]),
                    hidden=hidden,
                    row_start=int(layout.row_starts[index]),
                )  # fmt: skip
            )
            offset += num_new
        return ChannelStep(requests, layout.forget_keys[: layout.get("num_forgets")].tolist())

    def offer_ring(self, wanted: bool) -> None:
        """Say whether this server's drafts should cross in the ring (made by a model on its GPU)."""
        self._layout.set("ring_drafts", int(wanted))

    def respond(self, drafts: Sequence[Sequence[int]]) -> None:
        """Answer the step just read: drafts[i] for its i-th request, at most its num_drafts (in the
        ring when the step asked for that)."""
        layout = self._layout
        limited = [list(proposal[: int(layout.num_drafts[index])]) for index, proposal in enumerate(drafts)]
        if self._to_ring:
            self.ring.publish(limited, self._seq)
        else:
            for index, proposal in enumerate(limited):
                layout.drafts[index, : len(proposal)] = proposal
                layout.draft_lengths[index] = len(proposal)
        layout.set("response_seq", self._seq)  # last: this publishes the answer

    def respond_error(self, message: str) -> None:
        layout = self._layout
        if self._to_ring:  # no drafts, at once: the engine's verify step waits for the ring
            self.ring.publish([[] for _ in range(layout.get("num_requests"))], self._seq)
        encoded = message.encode("utf-8", "replace")[: ERROR_BYTES - 1]
        layout.error[:] = 0
        layout.error[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        layout.set("status", STATUS_ERROR)
        layout.set("response_seq", self._seq)

    def close(self) -> None:
        if self._mmap is None:
            return
        if self.ring is not None and self.ring.on_gpu:
            unmap_host_page(self._layout.header.ctypes.data)
        del self._layout
        self.ring = None
        self._mmap.close()
        self._mmap = None


def _write_description(area: np.ndarray, description: bytes) -> None:
    if len(description) > len(area):
        raise ValueError(f"a GPU buffer's description takes {len(description)} bytes, over {len(area)}")
    area[: len(description)] = np.frombuffer(description, dtype=np.uint8)


def _gpu_ring(layout: _Layout, storage: torch.Tensor) -> DraftRing | None:
    """A ring of `storage` (GPU memory) whose flag is the header's ring_flag, registered with CUDA in this
    process; None where that fails (the host ring then carries the drafts)."""
    try:
        address = map_host_page(layout.header.ctypes.data)  # the header starts the segment: a page
    except Exception:  # noqa: BLE001 - e.g. no CUDA driver: host memory will do
        return None
    host = layout.ring  # the same capacity and flag word
    flag_address = address + 8 * _FIELD["ring_flag"]
    return DraftRing(storage, host.max_requests, host.max_drafts, host.flag, flag_address)
