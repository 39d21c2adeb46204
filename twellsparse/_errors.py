"""Exception and warning types of twellsparse.

Every error is a builtin type (so ``except ValueError`` keeps working) with a narrow subclass
where callers may want to tell cases apart.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "TwELLCapacityError",
    "TwELLSpillCapacityError",
    "TwELLDroppedEntriesWarning",
    "TwELLFallbackWarning",
    "TwELLFormatError",
]


class TwELLCapacityError(ValueError):
    """A row-tile holds more nonzeros than the capacity, under ``overflow="error"``.

    Attributes
    ----------
    row, tile : int
        The worst row-tile (the first one with the largest count).
    count : int
        How many nonzeros that row-tile holds.
    capacity : int
        The slots per row-tile.
    n_overflowing : int
        How many row-tiles exceed the capacity.
    """

    def __init__(self, row: int, tile: int, count: int, capacity: int, n_overflowing: int):
        self.row, self.tile, self.count = row, tile, count
        self.capacity, self.n_overflowing = capacity, n_overflowing
        super().__init__(
            f"capacity: expected at most {capacity} nonzeros per row-tile, got {count} in "
            f"row {row}, tile {tile} ({n_overflowing} row-tiles overflow); "
            f'use overflow="spill" to keep them exactly or raise capacity'
        )


class TwELLSpillCapacityError(ValueError):
    """A plan with a fixed ``spill_capacity`` met more spilled entries than it holds: the output
    of the call named was computed without them (raised at the plan's next call or check, since
    the fixed capacity exists to avoid reading the count back during the call). A call on the
    exact path (the CPU, or operands the gather kernels do not take) raises it at once instead,
    returning nothing.

    Attributes
    ----------
    n_left_out : int
        Entries that did not fit.
    spill_capacity : int
        The plan's fixed spill length.
    """

    def __init__(self, n_left_out: int, spill_capacity: int, call: str, computed: bool = True):
        self.n_left_out, self.spill_capacity = n_left_out, spill_capacity
        consequence = f", so its output left {n_left_out} out" if computed else " (no output was returned)"
        super().__init__(
            f"spill_capacity: expected at most {spill_capacity} spilled entries, {call} had "
            f"{spill_capacity + n_left_out}{consequence}; raise spill_capacity or capacity"
        )


class TwELLFormatError(ValueError):
    """Component arrays that do not form a valid TwELL matrix."""


class TwELLDroppedEntriesWarning(UserWarning):
    """``overflow="drop"`` discarded entries beyond the capacity (the only lossy mode)."""


class TwELLFallbackWarning(UserWarning):
    """An operation ran on a slower path than the one asked for (never silently)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside twellsparse: the stack depth
    between a public entry point and the code that warns varies (plans, adapters, conversions),
    so no fixed ``stacklevel`` names the caller's line."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
