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

import torch
from tileinfer.proposers.cuda_ipc import describe, open_described


class DeviceRowsExport:
    """The engine's end: a [rows, width] buffer on `device`."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(rows, width, dtype=dtype, device=device)
        self.copied = torch.cuda.Event()

    def descriptor(self) -> bytes:
        """The buffer's IPC handle and the GPU's UUID, as JSON."""
        return describe(self.buffer)

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
        """Map the buffer a DeviceRowsExport described (proposers/cuda_ipc.py: into this process's GPU
        when that is a peer of the buffer's); None if this process cannot (rows then cross in host
        memory)."""
        buffer = open_described(descriptor)
        return None if buffer is None else cls(buffer)

    def read(self, row_offset: int, num_rows: int) -> torch.Tensor:
        """This step's rows from row_offset, copied (the engine's copies ended before the step came)."""
        return self.buffer[row_offset : row_offset + num_rows].clone()
