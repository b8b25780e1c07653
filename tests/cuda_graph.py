"""Capturing a step in a CUDA graph for the kernels' graph tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """step run once on a side stream (its kernels compile outside the capture, as PyTorch's capture
    recipe asks), then captured in a CUDA graph: replaying the graph runs step again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
