"""Signals to CUDA streams through a 32-bit word in pinned host memory, with no host wait in the loop: a
stream waits until the word reaches a value (cuStreamWaitValue32); a stream of another process writes
it (cuStreamWriteValue32) after its earlier work, or a host writes it with a plain store.

The word is in host memory, registered with CUDA in each process (map_host_page), rather than in GPU
memory: a stream blocked on a wait can hold back another stream of its own process that the GPU happens
to serialize behind it (CUDA's warning on these calls), so the engine must be able to release its own
wait from the host, with no CUDA call. Both calls are CUDA driver calls, made through ctypes: torch does
not expose them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, so counters may wrap
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
_REGISTER_PORTABLE_MAPPED = 0x3  # cudaHostRegisterPortable | cudaHostRegisterMapped
PAGE_BYTES = 4096


class StreamSignalError(RuntimeError):
    """CUDA refused a stream memory operation or a host registration."""


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        function = getattr(driver, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        function.restype = ctypes.c_int
    driver.cuMemHostGetDevicePointer_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint
    ]  # fmt: skip
    driver.cuMemHostGetDevicePointer_v2.restype = ctypes.c_int
    return driver


def _check(result: int, what: str) -> None:
    if int(result) != 0:
        raise StreamSignalError(f"{what} failed with CUDA error {int(result)}")


def map_host_page(address: int) -> int:
    """Register the host page at `address` (page-aligned) with CUDA for every GPU of this process and
    return its device address (the same for all of them)."""
    assert address % PAGE_BYTES == 0, "a signal page must be page-aligned"
    # the runtime call binds this thread's CUDA context first; the driver then gives the device address
    _check(torch.cuda.cudart().cudaHostRegister(address, PAGE_BYTES, _REGISTER_PORTABLE_MAPPED),
           "cudaHostRegister")  # fmt: skip
    device_address = ctypes.c_uint64()
    _check(_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(device_address), address, 0),
           "cuMemHostGetDevicePointer")  # fmt: skip
    return device_address.value


def unmap_host_page(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def wait_at_least(device_address: int, value: int, stream: torch.cuda.Stream) -> None:
    """Hold `stream`'s later work until the 32-bit word at device_address is at least `value`."""
    result = _driver().cuStreamWaitValue32_v2(
        stream.cuda_stream, device_address, value & 0xFFFFFFFF, _WAIT_GEQ
    )
    _check(result, "cuStreamWaitValue32")


def write_after(device_address: int, value: int, stream: torch.cuda.Stream) -> None:
    """Set the 32-bit word at device_address to `value` once `stream`'s earlier work is done."""
    result = _driver().cuStreamWriteValue32_v2(
        stream.cuda_stream, device_address, value & 0xFFFFFFFF, _WRITE_DEFAULT
    )
    _check(result, "cuStreamWriteValue32")
