"""GPU tensors shared between processes through CUDA IPC, described in JSON (no pickle crosses).

`describe(tensor)` gives the tensor's IPC handle and its GPU's UUID (a process numbers its GPUs by what
it sees, so the UUID names the GPU). `open_described(description)` maps it in another process: into
that process's current GPU when that is a peer of the owner (NVLink: reads and writes then cross as
peer accesses), else into the owner GPU; None when the process does not see the owner GPU or mapping
fails, so that the caller falls back to host memory.
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def describe(tensor: torch.Tensor) -> bytes:
    """`tensor`'s IPC handle and its GPU's UUID, as JSON."""
    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    description = {
        "gpu": gpu_uuid(device),
        "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).split(".")[-1],
        "handle": handle.hex(), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
        "ref_handle": ref_handle.hex(), "ref_offset": ref_offset,
        "event_handle": event_handle.hex() if event_handle else None, "event_sync": event_sync,
    }  # fmt: skip
    return json.dumps(description).encode()


def open_described(encoded: bytes) -> torch.Tensor | None:
    """Map the tensor `describe` gave, into the current GPU if it is a peer of the owner, else into the
    owner; None if this process does not see the owner GPU or the mapping fails."""
    if not torch.cuda.is_available():
        return None
    try:
        description = json.loads(encoded.decode())
    except ValueError:
        return None
    owner = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == description["gpu"]), None)
    if owner is None:
        return None
    current = torch.cuda.current_device()
    candidates = [owner]
    if current != owner and torch.cuda.can_device_access_peer(current, owner):
        candidates.insert(0, current)
    for index in candidates:
        with contextlib.suppress(Exception):  # any failure to map means: try the next, then host memory
            return _map(description, index)
    return None


def _map(description: dict, index: int) -> torch.Tensor:
    """Open the IPC handle in GPU `index`'s context (the tensor's own GPU, or a peer of it)."""
    event_handle = description["event_handle"]
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(description["size"]), tuple(description["stride"]),
        description["offset"], torch.UntypedStorage, getattr(torch, description["dtype"]), index,
        bytes.fromhex(description["handle"]), description["size_bytes"], description["offset_bytes"],
        False, bytes.fromhex(description["ref_handle"]), description["ref_offset"],
        bytes.fromhex(event_handle) if event_handle else None, description["event_sync"],
    )  # fmt: skip
