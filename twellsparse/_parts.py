"""The component arrays of a TwELL matrix, shared by the container, the reference and kernels."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class TwELLParts(NamedTuple):
    """Physical storage of an M x N TwELL matrix with ``T = n_tiles`` tiles and capacity ``C``.

    ``data`` (M, T, C) values; ``indices`` (M, T, C) int16 tile-local columns, -1 in unused slots;
    ``counts`` (M, T) int32 slots used; ``spill_data``/``spill_indices``/``spill_indptr`` a CSR
    matrix (global int32 columns) of the entries beyond the capacity. See docs/FORMAT.md.
    """

    data: Any
    indices: Any
    counts: Any
    spill_data: Any
    spill_indices: Any
    spill_indptr: Any


def trimmed_spill(parts: TwELLParts) -> TwELLParts:
    """``parts`` with spill arrays holding exactly their entries (one read-back of the count):
    a fixed ``spill_capacity`` makes them longer, which the GPU kernels read through the row
    pointers, but the CPU reference and a user-facing ``twell_array`` (its ``nnz`` counts the
    arrays) need exact."""
    n = int(parts.spill_indptr[-1])
    if n == parts.spill_data.shape[0]:
        return parts
    return parts._replace(spill_data=parts.spill_data[:n], spill_indices=parts.spill_indices[:n])


class DeferredFinish(Protocol):
    """The second half of a producer whose pass 1 already ran: ``finish(overflow)`` returns the
    complete parts and the dropped entries under that overflow policy (``spill_capacity``: a
    fixed-length spill, and the entries left out as a device scalar); ``count_now()`` starts
    reading the overflow count back before the caller queues more work (a no-op where the parts
    are complete already)."""

    def __call__(self, overflow: str, spill_capacity: int | None = None) -> tuple[TwELLParts, Any]: ...

    def count_now(self) -> None: ...
