"""The target's hidden-state rows (DFlash) in GPU memory shared by the engine's and the proposer's
processes through CUDA IPC, beside the shared-memory channel (proposers/channel.py) that signals the
steps.

The engine's end (DeviceRowsExport) allocates the row buffer and an interprocess event on its GPU once,
and describes them in JSON: that GPU's UUID and the IPC handles of the memory and the event (no pickle
crosses). The proposer's end (DeviceRowsImport.open) maps them when its process sees that GPU: on the
same GPU when both actors share one; when the proposer's own GPU (its current device) is another one
that can reach the engine's as a peer (NVLink), it maps the buffer into its own GPU, so reading the rows
is one peer copy. A process that does not see the engine's GPU gets None, and the rows cross in the
channel's host memory.

Each step the engine copies the rows into the buffer on its stream, records the event and waits for it
before it signals the step; the proposer's stream also waits for the event before it reads them. The
buffer is reused only after the proposer has answered, and it answers after its drafts are on the host
(which needs its reads done), so one buffer suffices. The channel says with each step whether its rows
are in this buffer: the proposer may map it between two steps.
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

DESCRIPTOR_BYTES = 4096  # room for the JSON description in the channel segment


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class DeviceRowsExport:
    """The engine's end: a [rows, width] buffer and an interprocess event on `device`."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(rows, width, dtype=dtype, device=device)
        self.event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        self.event.record()  # an interprocess event must be recorded before its handle is taken

    def descriptor(self) -> bytes:
        """The buffer's and the event's IPC handles, and the GPU's UUID, as JSON."""
        _, args = reduce_tensor(self.buffer)
        (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _,
         ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
        description = {
            "gpu": _gpu_uuid(device),
            "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).split(".")[-1],
            "handle": handle.hex(), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_handle": ref_handle.hex(), "ref_offset": ref_offset,
            "event_handle": event_handle.hex() if event_handle else None, "event_sync": event_sync,
            "step_event": bytes(self.event.ipc_handle()).hex(),
        }  # fmt: skip
        encoded = json.dumps(description).encode()
        if len(encoded) > DESCRIPTOR_BYTES:
            raise ValueError(
                f"the device-rows description takes {len(encoded)} bytes, over {DESCRIPTOR_BYTES}"
            )
        return encoded

    def write(self, row_offset: int, rows: torch.Tensor) -> None:
        """Copy rows (on any device) into the buffer from row_offset, on the current stream."""
        self.buffer[row_offset : row_offset + rows.shape[0]].copy_(rows, non_blocking=True)

    def publish(self) -> None:
        """Mark the end of this step's copies (the proposer's reads wait for this point) and wait for
        them on the host too, before the step is signalled: they are small, and they follow a step whose
        tokens the host has read already."""
        self.event.record()
        self.event.synchronize()


class DeviceRowsImport:
    """The proposer's end: the engine's buffer mapped into this process."""

    def __init__(self, buffer: torch.Tensor, event: torch.cuda.Event) -> None:
        self.buffer, self.event = buffer, event

    @classmethod
    def open(cls, descriptor: bytes) -> DeviceRowsImport | None:
        """Map the buffer a DeviceRowsExport described, into this process's current GPU when that is a
        peer of the buffer's GPU, else into the buffer's GPU; None if this process does not see that GPU
        or the mapping fails (the rows then cross in host memory)."""
        if not torch.cuda.is_available():
            return None
        try:
            description = json.loads(descriptor.decode())
        except ValueError:
            return None
        owner = next(
            (i for i in range(torch.cuda.device_count()) if _gpu_uuid(i) == description["gpu"]), None
        )
        if owner is None:
            return None
        current = torch.cuda.current_device()
        candidates = [owner]
        if current != owner and torch.cuda.can_device_access_peer(current, owner):
            candidates.insert(0, current)
        for index in candidates:
            with contextlib.suppress(Exception):  # any failure to map means: try the next, then host memory
                return cls._map(description, index)
        return None

    @classmethod
    def _map(cls, description: dict, index: int) -> DeviceRowsImport:
        """Open the IPC handles in GPU `index`'s context (the buffer's own GPU, or a peer of it)."""
        event_handle = description["event_handle"]
        buffer = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(description["size"]), tuple(description["stride"]),
            description["offset"], torch.UntypedStorage, getattr(torch, description["dtype"]), index,
            bytes.fromhex(description["handle"]), description["size_bytes"], description["offset_bytes"],
            False, bytes.fromhex(description["ref_handle"]), description["ref_offset"],
            bytes.fromhex(event_handle) if event_handle else None, description["event_sync"],
        )  # fmt: skip
        event = torch.cuda.Event.from_ipc_handle(index, bytes.fromhex(description["step_event"]))
        return cls(buffer, event)

    def read(self, row_offset: int, num_rows: int) -> torch.Tensor:
        """This step's rows from row_offset, copied (on the current stream, after the engine's copies)."""
        torch.cuda.current_stream(self.buffer.device).wait_event(self.event)
        return self.buffer[row_offset : row_offset + num_rows].clone()
