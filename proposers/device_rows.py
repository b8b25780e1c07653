"""The target's hidden-state rows (DFlash) in GPU memory shared by the engine's and the proposer's
processes through CUDA IPC, beside the shared-memory channel (proposers/channel.py) that signals the
steps.

The engine's end (DeviceRowsExport) allocates the row buffer on its GPU once, and describes it in JSON:
that GPU's UUID and the buffer's IPC handle (no pickle crosses). The proposer's end
(DeviceRowsImport.open) maps it when its process sees that GPU: on the same GPU when both actors share
one; when the proposer's own GPU (its current device) is another one that can reach the engine's as a
peer (NVLink), it maps the buffer into its own GPU, so reading the rows is one peer copy. A process that
does not see the engine's GPU gets None, and the rows cross in the channel's host memory.

Each step the engine copies the rows into the buffer on its stream and waits for the copies on the
host before it signals the step, so the proposer reads complete rows without waiting on an event. The
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
        self.copied = torch.cuda.Event()

    def descriptor(self) -> bytes:
        """The buffer's IPC handle and the GPU's UUID, as JSON."""
        _, args = reduce_tensor(self.buffer)
        (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _,
         ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
        description = {
            "gpu": _gpu_uuid(device),
            "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).split(".")[-1],
            "handle": handle.hex(), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_handle": ref_handle.hex(), "ref_offset": ref_offset,
            "event_handle": event_handle.hex() if event_handle else None, "event_sync": event_sync,
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
        """Wait on the host for this step's copies, before the step is signalled: they are small, and
        they follow a step whose tokens the host has read already."""
        self.copied.record()
        self.copied.synchronize()


class DeviceRowsImport:
    """The proposer's end: the engine's buffer mapped into this process."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

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
        """Open the IPC handle in GPU `index`'s context (the buffer's own GPU, or a peer of it)."""
        event_handle = description["event_handle"]
        buffer = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(description["size"]), tuple(description["stride"]),
            description["offset"], torch.UntypedStorage, getattr(torch, description["dtype"]), index,
            bytes.fromhex(description["handle"]), description["size_bytes"], description["offset_bytes"],
            False, bytes.fromhex(description["ref_handle"]), description["ref_offset"],
            bytes.fromhex(event_handle) if event_handle else None, description["event_sync"],
        )  # fmt: skip
        return cls(buffer)

    def read(self, row_offset: int, num_rows: int) -> torch.Tensor:
        """This step's rows from row_offset, copied (the engine's copies ended before the step came)."""
        return self.buffer[row_offset : row_offset + num_rows].clone()
