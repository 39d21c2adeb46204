"""CUDA-graph capture of a torch callable for the benchmarks: the host's launch costs vanish from
the timed replays, so a step's time is its GPU work alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def fresh_leaves(module: torch.nn.Module) -> None:
    """Give every parameter of ``module`` a new tensor object (same values). Autograd keeps one
    gradient-accumulator node per leaf tensor, tied to the stream it was made on; leaves used
    eagerly on the default stream before a capture would make the captured backward touch the
    legacy stream, which capture forbids. New leaves get their nodes during the side-stream
    warm-up."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def captured(fn: Callable[[], Any], warmup: int = 2) -> Callable[[], None]:
    """``fn`` captured whole in a CUDA graph; returns its replay. ``fn`` runs ``warmup`` times
    on a side stream first (kernels compiled, library plans and workspaces made), as capture
    requires; what it allocates during the capture lives in the graph's private pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
