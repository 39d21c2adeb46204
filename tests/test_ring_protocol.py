"""The tiled kernels' shared-memory rings as a protocol, run under random schedules on the CPU:
mbarriers (arrival counts, transaction bytes, phases, try_wait by parity), asynchronous TMA
copies that land whenever the scheduler lets them, consumer warps and the copying thread (lane
0 of warp 0, which consumes too, and issues use R + 3 after releasing use R, on from one tile or
round into the next), for twell_tiled_spmm's ring and for twell_tiled_ffn_up's, alone and in
pairs of CTAs sharing x by multicast (a stage refilled once the warps of both CTAs have
released it). Every schedule must finish (no deadlock), every warp must read each stage only
after all of its copies for that use landed, and no copy may land in a stage a warp of its CTA
has not released. The same for twell_tiled_up.cu's two buffers (a block-wide sync after each
buffer's sums, then the copying thread's release and refill; each round restarts at slice 0),
alone and in pairs of CTAs sharing x's boxes. A model of the kernels' control flow, not of their
arithmetic (that is tests/tiled_spmm_model.py's)."""

from __future__ import annotations

import numpy as np
import pytest

STAGES = 3


class Barrier:
    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _check(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def arrive(self, tx: int = 0) -> None:
        self.tx += tx
        self.pending -= 1
        assert self.pending >= 0
        self._check()

    def complete(self, tx: int) -> None:
        self.tx -= tx
        self._check()

    def done(self, parity: int) -> bool:  # mbarrier.try_wait.parity: the phase of that parity completed
        return (self.phase & 1) != parity


def run(kind: str, cluster: int, issues: int, rng: np.random.Generator, warps: int = 4) -> None:
    """One random schedule of ``issues`` ring uses; raises on a deadlock or a data race. A stage
    holds 16 KB parts: B's two boxes (spmm), or W_up's two and x's two (ffn), x's box r coming
    from the cluster's CTA r to both CTAs when the CTAs pair up."""
    n_parts = 2 if kind == "spmm" else 4
    full = [[Barrier(1) for _ in range(STAGES)] for _ in range(cluster)]
    empty_count = warps * cluster if kind == "ffn" else warps
    empty = [[Barrier(empty_count) for _ in range(STAGES)] for _ in range(cluster)]
    landed = [[[None] * n_parts for _ in range(STAGES)] for _ in range(cluster)]  # the issue each part holds
    released = [[[-1] * warps for _ in range(STAGES)] for _ in range(cluster)]  # last use each warp released
    copies: list[tuple[int, int, int, int]] = []  # (destination CTA, stage, part, issue) in flight
    # Each warp's program: ("wait", R) -> ("release", R) -> warp 0 also ("issue", R + STAGES)
    state = [[("wait", 0) for _ in range(warps)] for _ in range(cluster)]

    def issue(c: int, it: int) -> bool:
        s = it % STAGES
        if not empty[c][s].done(((it // STAGES) & 1) ^ 1):  # the previous use released (parity trick)
            return False
        full[c][s].arrive(tx=n_parts)  # expect_tx: the whole stage
        if kind == "ffn" and cluster == 2:
            copies.extend([(c, s, 0, it), (c, s, 1, it)] + [(d, s, 2 + c, it) for d in range(cluster)])
        else:
            copies.extend((c, s, p, it) for p in range(n_parts))
        return True

    for c in range(cluster):
        for it in range(min(STAGES, issues)):
            assert issue(c, it)
    for _ in range(100000):
        runnable = [("copy", i) for i in range(len(copies))]
        for c in range(cluster):
            for w in range(warps):
                op, r = state[c][w]
                if op == "done" or (op == "wait" and not full[c][r % STAGES].done((r // STAGES) & 1)):
                    continue
                runnable.append(("warp", (c, w)))
        if not runnable:
            assert all(op == "done" for row in state for op, _ in row), f"deadlock: {state}"
            return
        what, who = runnable[rng.integers(len(runnable))]
        if what == "copy":
            d, s, p, it = copies.pop(who)
            assert all(r >= it - STAGES for r in released[d][s]), "a copy landed in a stage still in use"
            landed[d][s][p] = it
            full[d][s].complete(1)
            continue
        c, w = who
        op, r = state[c][w]
        s = r % STAGES
        if op == "wait":
            assert landed[c][s] == [r] * n_parts, f"a warp read stage {s} holding {landed[c][s]} for use {r}"
            state[c][w] = ("release", r)
        elif op == "release":
            released[c][s][w] = r
            for d in range(cluster) if kind == "ffn" else (c,):
                empty[d][s].arrive()
            if w == 0 and r + STAGES < issues:
                state[c][w] = ("issue", r + STAGES)
            else:
                state[c][w] = ("wait", r + 1) if r + 1 < issues else ("done", r)
        elif op == "issue" and issue(c, r):
            state[c][w] = ("wait", r - STAGES + 1)
    raise AssertionError("the schedule did not finish")


@pytest.mark.parametrize("kind, cluster", [("spmm", 1), ("ffn", 1), ("ffn", 2)])
@pytest.mark.parametrize("issues", [1, 2, 3, 4, 7, 20])
def test_rings_finish_and_never_race_under_random_schedules(kind, cluster, issues):
    rng = np.random.default_rng(issues * 10 + cluster)
    for _ in range(60):
        run(kind, cluster, issues, rng)


def test_the_model_catches_a_refill_without_waiting():
    """A copy thread that refills a stage without waiting on its empty barrier (the model of the
    bug the barrier prevents) is caught as a race under some schedule."""
    rng = np.random.default_rng(0)
    saved = Barrier.done
    try:
        Barrier.done = lambda self, parity: True  # every wait passes at once
        with pytest.raises(AssertionError):
            for _ in range(200):
                run("ffn", 2, 9, rng)
    finally:
        Barrier.done = saved


def run_up(
    cluster: int, rounds: int, n_slices: int, x_boxes: int, rng: np.random.Generator, wait_empty: bool = True
) -> None:
    """One random schedule of twell_tiled_up.cu's ring: per CTA, ``rounds`` rounds of
    ``n_slices`` slices, slice s of a round in buffer s % 2; the block (one agent: its warps meet
    at a __syncthreads after each buffer's sums) waits for the buffer's full barrier, sums, then
    its copying thread releases the buffer (pairs: an arrival on both CTAs' empty barriers) and
    refills it with slice s + 2, or, at a round's start, fills both. A fill first waits on the
    buffer's empty barrier for the previous fill's release (pairs only; the parity trick lets
    each buffer's first fill pass) and copies W_up's box to its CTA and x's boxes: all to its own
    CTA alone, or in pairs box i from CTA i % 2 to both. Raises on a deadlock or a race.
    ``wait_empty=False`` drops the pairs' wait (a mutation the model must catch)."""
    waits = cluster > 1 and wait_empty
    uses = [(r, s) for r in range(rounds) for s in range(n_slices)]
    n_parts = 1 + x_boxes
    full = [[Barrier(1) for _ in range(2)] for _ in range(cluster)]
    empty = [[Barrier(cluster) for _ in range(2)] for _ in range(cluster)]
    fills = [[0, 0] for _ in range(cluster)]
    landed = [[[None] * n_parts for _ in range(2)] for _ in range(cluster)]
    released = [[-1, -1] for _ in range(cluster)]  # the last use of each buffer the CTA released
    copies: list[tuple[int, int, int, int]] = []  # (destination CTA, buffer, part, use) in flight

    def previous(k: int) -> int:  # the use before k of k's buffer, or -1
        b = uses[k][1] % 2
        return max((j for j in range(k) if uses[j][1] % 2 == b), default=-1)

    def fill(c: int, k: int) -> bool:
        b = uses[k][1] % 2
        if waits and not empty[c][b].done((fills[c][b] & 1) ^ 1):
            return False
        fills[c][b] += 1
        full[c][b].arrive(tx=n_parts)
        copies.append((c, b, 0, k))  # W_up's rows, this CTA's own
        for i in range(x_boxes):
            if cluster == 1:
                copies.append((c, b, 1 + i, k))
            elif i % 2 == c:
                copies.extend((d, b, 1 + i, k) for d in range(cluster))
        return True

    # Each CTA's program: ("fill", [uses to fill]) before ("sum", k), then ("release", k).
    def fills_after(k: int) -> list[int]:  # what the copying thread fills after releasing use k
        r, s = uses[k]
        if s + 2 < n_slices:
            return [k + 2]
        if s == n_slices - 1 and r + 1 < rounds:  # the round's last slice: the next round starts
            return [k + 1] + ([k + 2] if n_slices > 1 else [])
        return []

    start = [0] + ([1] if n_slices > 1 else [])
    state = [("fill", list(start), 0) for _ in range(cluster)]
    for _ in range(100000):
        runnable = [("copy", i) for i in range(len(copies))]
        for c in range(cluster):
            op, todo, k = state[c]
            if op == "done" or (op == "sum" and not full[c][uses[k][1] % 2].done(_parity(uses, k))):
                continue
            if (
                op == "fill"
                and waits
                and not empty[c][uses[todo[0]][1] % 2].done((fills[c][uses[todo[0]][1] % 2] & 1) ^ 1)
            ):
                continue
            runnable.append(("cta", c))
        if not runnable:
            assert all(op == "done" for op, _, _ in state), f"deadlock: {state}"
            return
        what, who = runnable[rng.integers(len(runnable))]
        if what == "copy":
            d, b, p, k = copies.pop(who)
            assert released[d][b] >= previous(k), "a copy landed in a buffer still in use"
            landed[d][b][p] = k
            full[d][b].complete(1)
            continue
        c = who
        op, todo, k = state[c]
        b = uses[k][1] % 2
        if op == "fill":
            assert fill(c, todo[0])
            todo = todo[1:]
            state[c] = ("fill", todo, k) if todo else ("sum", [], k)
        elif op == "sum":
            assert landed[c][b] == [k] * n_parts, f"CTA {c} summed buffer {b} holding {landed[c][b]} for use {k}"
            state[c] = ("release", [], k)
        else:  # release, then the refills, then the next use's sums
            released[c][b] = k
            if cluster > 1:  # pairs: both CTAs' empty barriers (single blocks: the sync alone)
                for d in range(cluster):
                    empty[d][b].arrive()
            nxt = ("sum", [], k + 1) if k + 1 < len(uses) else ("done", [], k)
            todo = fills_after(k)
            state[c] = ("fill", todo, k + 1) if todo else nxt
    raise AssertionError("the schedule did not finish")


def _parity(uses: list[tuple[int, int]], k: int) -> int:
    """The full barrier's phase parity use k waits for: its buffer's fills before it."""
    b = uses[k][1] % 2
    return sum(1 for j in range(k) if uses[j][1] % 2 == b) & 1


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("rounds, n_slices", [(1, 1), (1, 2), (1, 5), (2, 3), (3, 4), (2, 1)])
@pytest.mark.parametrize("x_boxes", [1, 2, 3])
def test_tiled_up_ring_finishes_and_never_races(cluster, rounds, n_slices, x_boxes):
    rng = np.random.default_rng(rounds * 100 + n_slices * 10 + x_boxes + 1000 * cluster)
    for _ in range(40):
        run_up(cluster, rounds, n_slices, x_boxes, rng)


def test_the_tiled_up_model_catches_a_pair_refill_without_waiting():
    """Pairs whose copying thread refills a buffer without waiting for both CTAs' releases (the
    single blocks' protocol, whose sync frees a buffer only in its own CTA) race under some
    schedule."""
    rng = np.random.default_rng(1)
    with pytest.raises(AssertionError, match="a copy landed in a buffer still in use"):
        for _ in range(300):
            run_up(2, 2, 5, 2, rng, wait_empty=False)
