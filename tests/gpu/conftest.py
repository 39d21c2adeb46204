"""GPU test fixtures: every device allocation is poisoned (all bytes 0xFF: NaN for every float
dtype, -1 for integers) so an output element a kernel forgot to write cannot pass as zero."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def poisoned_allocations():
    try:
        import cupy as cp
    except ImportError:
        yield
        return
    pool = cp.get_default_memory_pool()

    def malloc(size: int):
        mem = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(pool.malloc)


@pytest.fixture
def poisoned_torch_allocations(cp, monkeypatch):
    """The torch adapter's CuPy arrays come from torch's caching allocator
    (``tt._torch_allocator``, under ``cupy.cuda.using_allocator``), which bypasses the poisoned
    pool above: poison those too (all bytes 0xFF), on CuPy's current stream, which inside the
    adapter is torch's. Inside a graph capture the memset is captured with the kernels, so every
    replay poisons the graph's buffers again before they are written. For the adapter's test
    files (``pytest.mark.usefixtures``)."""
    import types

    import twellsparse.torch as tt

    torch_malloc = tt._torch_allocator().malloc

    def malloc(size: int):
        mem = torch_malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    poisoned = types.SimpleNamespace(malloc=malloc)
    monkeypatch.setattr(tt, "_torch_allocator", lambda: poisoned)
