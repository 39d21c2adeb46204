"""A device scalar read on the host later, without a synchronisation where it is posted."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np

from ._backend import is_cupy_array


class PostedScalar:
    """A device scalar of one call (the kept fraction of its activations, the spilled entries it
    left out, a pack's overflow count), copied to pinned host memory without waiting and read
    later (at the next call, or after more work is queued): no host synchronisation where it is
    posted.

    Posted while a CUDA graph is being captured, the copy becomes part of the graph: every
    replay rewrites the host value, which is then read as it stands (the caller synchronises).
    """

    def __init__(self) -> None:
        self._host: Any = None
        self._event: Any = None
        self._value: float | None = None
        self._in_graph = False
        # Two pinned buffers, posted to in turn: a value taken out with pop() keeps its buffer
        # until it is read, while the next call posts into the other one.
        self._buffers: list[Any] = [None, None]
        self._turn = 0
        # How the 8 host bytes read (the posted array's dtype) and the factor applied on reading.
        self._dtype: Any = np.dtype(np.float64)
        self._scale = 1.0

    def post(self, scalar: Any, scale: float = 1.0) -> None:
        """Record a one-element device array (copied asynchronously) or a host number, read back
        times ``scale`` (a count posted raw becomes a fraction on the host, with no division
        launched on the device)."""
        self._scale = float(scale)
        if not is_cupy_array(scalar):
            self._value, self._event = float(scalar) * self._scale, None
            return
        import cupy as cp
        import cupyx

        if self._buffers[self._turn] is None:
            self._buffers[self._turn] = cupyx.zeros_pinned((1,), dtype=np.float64)
        self._host = self._buffers[self._turn]
        self._turn ^= 1
        if scalar.dtype in (np.float64, np.int64) and scalar.size == 1:
            staged, self._dtype = scalar, scalar.dtype  # its 8 bytes as they stand (stream order)
        else:
            staged, self._dtype = scalar.astype(cp.float64), np.dtype(np.float64)
        stream = cp.cuda.get_current_stream()
        # A raw asynchronous copy into pinned memory: CuPy's ``get`` refuses device-to-host copies
        # while capturing, but the runtime records this one as a memcpy node of the graph.
        cp.cuda.runtime.memcpyAsync(
            self._host.ctypes.data, staged.data.ptr, 8, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr
        )
        if stream.is_capturing():
            self._in_graph, self._event = True, None
        else:
            self._event = stream.record()

    def value(self) -> float | None:
        """The last recorded value (None before the first)."""
        return self._settled(wait=True)

    def latest(self) -> float | None:
        """:meth:`value` without waiting: the last posted value if its copy has landed, else the
        last value read (None before any): for choices that a stale value only makes slower. While
        the current stream is being captured nothing is queried (the event query is not a
        capture-safe call): the value known before the capture."""
        import cupy as cp

        if cp.cuda.get_current_stream().is_capturing():
            return self._value
        return self._settled(wait=False)

    def _settled(self, wait: bool) -> float | None:
        """The posted value once its copy has landed (waiting for it if ``wait``, else the last
        value read while it is in flight); a value a captured graph rewrites is read as it
        stands."""
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.done:
                return self._value
            self._value, self._event = self._read(), None
        elif self._in_graph:
            self._value = self._read()
        return self._value

    def _read(self) -> float:
        return float(self._host.view(self._dtype)[0]) * self._scale

    def take(self) -> float | None:
        """:meth:`value`, then forget it (zeroing the host copy a captured graph rewrites)."""
        v = self.value()
        self._value = None
        if self._host is not None:
            self._host[0] = 0.0
        return v

    def pop(self) -> PostedScalar:
        """The last posted value, still unread, as its own object (read it with :meth:`take`);
        this one starts empty. A call pops its predecessor's value first and reads it after
        queuing its own work, so the host never waits for the GPU with nothing queued."""
        popped = PostedScalar()
        popped._host, popped._event, popped._value, popped._in_graph = (
            self._host,
            self._event,
            self._value,
            self._in_graph,
        )
        popped._dtype, popped._scale = self._dtype, self._scale
        self._event, self._value = None, None
        return popped


class PostedByKey:
    """One :class:`PostedScalar` per key for calls that recur without a plan to hold one (the
    framework adapters' forwards, keyed by their weights): :meth:`get` returns the key's
    scalar, made on first use; beyond ``slots`` keys the least recently used is dropped (a
    weight copied anew every call, as under autocast, then never finds its previous value)."""

    def __init__(self, slots: int = 256) -> None:
        self._slots = slots
        self._scalars: OrderedDict[Hashable, PostedScalar] = OrderedDict()
        self._lock = threading.Lock()  # the adapters may call from several threads

    def get(self, key: Hashable) -> PostedScalar:
        with self._lock:
            scalar = self._scalars.pop(key, None) or PostedScalar()
            self._scalars[key] = scalar
            while len(self._scalars) > self._slots:
                self._scalars.popitem(last=False)
            return scalar

    def __len__(self) -> int:
        return len(self._scalars)
