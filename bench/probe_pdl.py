"""Does programmatic dependent launch (PDL) shorten a chain of small kernels replayed in a CUDA graph?

    python bench/probe_pdl.py

A chain of CHAIN dependent small kernels (each reads the previous one's output), captured in a CUDA graph
with and without `launch_pdl=True` (the kernels wait with gdc_wait before reading); prints the GPU time
per kernel of each, and checks that both give the same result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHAIN = 200


@triton.jit
def _step_kernel(src_ptr, w_ptr, dst_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr + offs, mask=mask)  # independent of the previous kernel: may run before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, x * 0.5 + w, mask=mask)


def run(use_pdl: bool, n: int, programs: int) -> tuple[float, torch.Tensor]:
    block = max(128, triton.next_power_of_2(triton.cdiv(n, programs)))
    bufs = [torch.ones(n, device="cuda") for _ in range(2)]
    weights = torch.rand(CHAIN, n, device="cuda")

    def chain() -> None:
        for i in range(CHAIN):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            kwargs = {"launch_pdl": True} if use_pdl else {}
            _step_kernel[(triton.cdiv(n, block),)](src, weights[i], dst, n, BLOCK=block, USE_PDL=use_pdl,
                                                  **kwargs)  # fmt: skip

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    bufs[0].fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    result = bufs[CHAIN % 2].clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 20 / CHAIN, result


def main() -> None:
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    for n, programs in ((4096, 1), (1 << 20, 132), (1 << 22, 528)):
        plain_us, plain = run(False, n, programs)
        try:
            pdl_us, pdl = run(True, n, programs)
        except Exception as error:  # noqa: BLE001 - report why PDL is unavailable
            print(f"n={n}: PDL failed: {type(error).__name__}: {error}")
            continue
        same = torch.allclose(plain, pdl)
        timing = f"plain {plain_us:6.2f} us/kernel, pdl {pdl_us:6.2f} us/kernel"
        print(f"n={n:8d} programs~{programs:4d}: {timing}, same result {same}")


if __name__ == "__main__":
    main()
