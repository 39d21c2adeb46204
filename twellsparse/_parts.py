"""The component arrays of a TwELL matrix, shared by the container, the reference and kernels."""

from __future__ import annotations

from typing import Any, NamedTuple


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
