"""A model of the tiled SpMM (cuda/twell_tiled_spmm.cu) for the tests: its pack written
independently of the kernels (the octet order over the swizzle's row classes, stated as a list
rather than as the kernel's position formula), and a lane-by-lane emulation of one product on
that pack which follows the kernel's address and register algebra against the PTX ISA's
definitions of ldmatrix (.trans), the m16n8k16 fragments and the 128-byte TMA swizzle. The
emulation runs on the CPU, so CI checks the algebra without a GPU; the GPU tests compare the
device's pack with :func:`reference_pack` word for word."""

from __future__ import annotations

import numpy as np

from twellsparse import _tiled_spmm as T

LANES = np.arange(32)
G, TQ = LANES >> 2, LANES & 3  # the MMA fragments' row (g) and column pair (t) per lane


def _bits(values) -> np.ndarray:
    return np.asarray(values).view(np.uint16).astype(np.uint32)


def _entries_by_row(parts, tile_n):
    """Each row's stored entries of a TwELL matrix's host parts as (column, source) in the walk
    order: its slots tile by tile, then its spill; source: slot index, or ~spill index."""
    m, nt, cap = parts.data.shape
    rows = []
    for row in range(m):
        entries = []
        for t in range(nt):
            for s in range(int(parts.counts[row, t])):
                entries.append((t * tile_n + int(parts.indices[row, t, s]), (row * nt + t) * cap + s))
        for i in range(int(parts.spill_indptr[row]), int(parts.spill_indptr[row + 1])):
            entries.append((int(parts.spill_indices[i]), ~i))
        rows.append(entries)
    return rows


def _value_bits(values, source) -> int:
    data, spill = values
    return int(_bits(data.reshape(-1)[source] if source >= 0 else spill[~source]))


def octet_places(total) -> tuple[dict, int]:
    """The octet plan of an item with class counts ``total`` (8 ints), built slot by slot:
    ``(places, octets)``, places[(q, k)] the position of class q's entry k. An item of n entries
    has O = 2 ceil(n / 16) octets (its k-groups' halves). For d = 0 .. O: the first O - d
    octets take class q's first O - d entries, one per octet at slot q; the rest of all classes,
    listed class by class, deal round robin over the last d octets, each filling its slots in
    order. A d whose rest fits (at most 8 per octet) costs O - d + d x (the most entries of one
    class in one of the last d octets, at least 1): those octets' wavefronts at most; the plan
    is the first d of least cost."""
    n = int(sum(total))
    octets = 2 * -(-n // 16)
    best = None
    for d in range(octets + 1):
        single = octets - d
        places = {(q, k): 8 * k + q for q in range(8) for k in range(min(single, int(total[q])))}
        rest = [(q, k) for q in range(8) for k in range(single, int(total[q]))]
        if len(rest) > 8 * d:
            continue
        classes: list = [[] for _ in range(octets)]
        for (q, _), p in places.items():
            classes[p // 8].append(q)
        for i, (q, k) in enumerate(rest):
            o = single + i % d
            places[(q, k)] = 8 * o + len(classes[o])
            classes[o].append(q)
        most = max([1] + [c.count(q) for c in classes[single:] for q in c])
        cost = single + d * most
        if best is None or cost < best[0]:
            best = (cost, places)
    return best[1], octets


def octet_order(entries: list) -> list:
    """An item's positions (whole k-groups of 16): its entries ((row, column in chunk, source) in
    walk order) at :func:`octet_places` (class: column % 8, k: the entry's rank among its class in
    walk order); None where no entry lands (padding)."""
    buckets = [[e for e in entries if e[1] % 8 == q] for q in range(8)]
    places, octets = octet_places([len(b) for b in buckets])
    slots: list = [None] * (8 * octets)
    for q, bucket in enumerate(buckets):
        for k, e in enumerate(bucket):
            slots[places[(q, k)]] = e
    return slots


def padding_sources(filled: list) -> list:
    """Per position of an item (``filled``: whether an entry lands there), the position whose
    word a padding word repeats (value zero, the mark): the first entry of its own octet, or of
    octet 0 when its octet has none; None where an entry lands."""
    firsts = [next((o + s for s in range(8) if filled[o + s]), None) for o in range(0, len(filled), 8)]
    return [None if f else (firsts[p // 8] if firsts[p // 8] is not None else firsts[0]) for p, f in enumerate(filled)]


def kernel_octet_plan(total) -> tuple[int, int, int]:
    """``octet_plan`` of cuda/twell_tiled.cuh as the kernels compute it: ``(octets, single,
    rest)``."""
    n, c_max = sum(total), max(total)
    octets = 2 * ((n + 15) >> 4)
    bound = max(octets, c_max)
    best, best_cost = (octets, octets, 0), (octets if c_max <= octets else 2**31 - 1)
    d = 1
    while d <= octets and best_cost > bound:
        single = octets - d
        rests = [max(0, t - single) for t in total]
        cost = single + max([1] + [(r + d - 1) // d for r in rests]) * d
        if sum(rests) <= 8 * d and cost < best_cost:
            best, best_cost = (octets, single, sum(rests)), cost
        d += 1
    return best


def kernel_octet_position(plan, total, q: int, k: int) -> int:
    """``octet_position`` of cuda/twell_tiled.cuh."""
    octets, single, _ = plan
    if k < single:
        return 8 * k + q
    i = k - single + sum(max(0, total[c] - single) for c in range(q))
    d = octets - single
    return 8 * (single + i % d) + i // d


def kernel_padding_source(plan, total, p: int) -> int:
    """``octet_padding_source`` of cuda/twell_tiled.cuh (-1 where an entry lands)."""
    octets, single, rest = plan
    o, slot = p >> 3, p & 7
    if o < single:
        if total[slot] > o:
            return -1
        for c in range(8):
            if total[c] > o:
                return 8 * o + c
    else:
        x, d = o - single, octets - single
        if slot * d + x < rest:
            return -1
        if x < rest:
            return 8 * o
    if single == 0:
        return 0
    return next((c for c in range(8) if total[c] > 0), 0)


def _packed(lines, n_out: int, n_in: int, values, dests=None) -> tuple[np.ndarray, list[np.ndarray], int]:
    """The pack of an operand whose output row r holds the entries ``lines[r]`` ((column,
    source) in walk order; columns below ``n_in``): per item (group of 8 rows, chunk of 512
    columns) the entries placed by :func:`octet_order`, padding words (:func:`padding_sources`'
    words with value zero and the padding mark) in the positions left; one word array per ``(data,
    spill)`` value pair. ``dests``, a list, gets each word's source (PAD for
    padding)."""
    n_chunks = -(-n_in // T.CHUNK)
    kg_ptr, words = [0], [[] for _ in values]
    for grp in range(-(-n_out // T.GROUP)):
        for c in range(n_chunks):
            c0 = c * T.CHUNK
            entries = [
                (r, col - c0, source)
                for r in range(T.GROUP)
                if grp * T.GROUP + r < n_out
                for col, source in lines[grp * T.GROUP + r]
                if c0 <= col < c0 + T.CHUNK
            ]
            slots = octet_order(entries)  # entry or None (padding) per position
            if dests is not None:
                dests += [T.PAD if e is None else e[2] for e in slots]
            sources = padding_sources([e is not None for e in slots])
            for out, vals in zip(words, values, strict=True):
                item = [None if e is None else T.word(_value_bits(vals, e[2]), e[0], e[1]) for e in slots]
                out += [w if at is None else item[at] & 0xFFFF | T.PAD_BIT for w, at in zip(item, sources, strict=True)]
            padded = len(slots)
            kg_ptr.append(kg_ptr[-1] + padded // T.KGROUP)
    return np.array(kg_ptr, dtype=np.int64), [np.array(w, dtype=np.uint32) for w in words], n_chunks


def reference_pack(parts, tile_n: int, k: int, others=(), dests=None) -> tuple[np.ndarray, list[np.ndarray], int]:
    """``(kg_ptr, words, n_chunks)`` as ``_tiled_spmm.pack`` must write them from host parts of a
    TwELL A with ``k`` columns (``others``: more host parts of A's structure, other values;
    ``dests``: a list that gets the words' places in A's parts)."""
    values = [(p.data, p.spill_data) for p in (parts, *others)]
    return _packed(_entries_by_row(parts, tile_n), parts.data.shape[0], k, values, dests)


def reference_pack_transposed(parts, tile_n: int, n_cols: int, others=()) -> tuple[np.ndarray, list[np.ndarray], int]:
    """What ``_tiled_spmm.pack_transposed`` must write for A.T (``n_cols`` rows: A's columns;
    chunks over A's tokens): each column's tokens increasing."""
    by_column = [[] for _ in range(n_cols)]
    for token, entries in enumerate(_entries_by_row(parts, tile_n)):
        for col, source in entries:
            by_column[col].append((token, source))
    lines = [sorted(column) for column in by_column]
    values = [(p.data, p.spill_data) for p in (parts, *others)]
    return _packed(lines, n_cols, parts.data.shape[0], values)


def _staged(b: np.ndarray, k0: int, col0: int) -> np.ndarray:
    """One stage as TMA writes it: rows k0 .. k0 + 511 and columns col0 .. col0 + 63 of b (zeros
    past its edges) as 512 rows of 128 bytes, the 16-byte piece p of row r stored at piece p ^
    (r % 8) (the 128-byte swizzle on a 1024-byte aligned stage). Float64 of b's values."""
    logical = np.zeros((T.CHUNK, T.COLS))
    part = b[k0 : k0 + T.CHUNK, col0 : col0 + T.COLS].astype(np.float64)
    logical[: part.shape[0], : part.shape[1]] = part
    physical = np.empty_like(logical)
    for p in range(T.COLS // 8):
        for r in range(T.CHUNK):
            q = p ^ (r % 8)
            physical[r, 8 * q : 8 * q + 8] = logical[r, 8 * p : 8 * p + 8]
    return physical


def _ldmatrix_x4_trans(stage: np.ndarray, rows: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4.trans.b16 (PTX ISA): lanes 8i .. 8i + 7 address the 8 rows of
    matrix i (16 bytes each); with .trans, lane 4g + t receives in register i the matrix's
    elements (row 2t, column g) and (row 2t + 1, column g). Returns [lane, register, half]."""
    fetched = np.stack([stage[rows[lane], 8 * pieces[lane] : 8 * pieces[lane] + 8] for lane in range(32)])
    regs = np.empty((32, 4, 2))
    for i in range(4):
        matrix = fetched[8 * i : 8 * i + 8]  # [row][column]
        regs[:, i, 0] = matrix[2 * TQ, G]
        regs[:, i, 1] = matrix[2 * TQ + 1, G]
    return regs


def _mma_m16n8k16(a_regs: np.ndarray, b_regs: np.ndarray) -> np.ndarray:
    """D = A B of one m16n8k16 from the lanes' fragments (PTX ISA layout, lane = 4g + t): a0 = A[g]
    [2t, 2t + 1], a1 = A[g + 8][2t, 2t + 1], a2 = A[g][2t + 8, 2t + 9], a3 = A[g + 8][2t + 8, 2t + 9];
    b0 = B[2t, 2t + 1][g], b1 = B[2t + 8, 2t + 9][g]; returns d per lane: D[g][2t], D[g][2t + 1],
    D[g + 8][2t], D[g + 8][2t + 1]."""
    a, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = G[lane], TQ[lane]
        for reg, (row, kk) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, kk : kk + 2] = a_regs[lane, reg]
        for reg, kk in enumerate((2 * t, 2 * t + 8)):
            bm[kk : kk + 2, g] = b_regs[lane, reg]
    d = a @ bm
    return np.stack([d[G, 2 * TQ], d[G, 2 * TQ + 1], d[G + 8, 2 * TQ], d[G + 8, 2 * TQ + 1]], axis=1)


def _value(bits: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(dtype).astype(np.float64)


def _kgroup(words: np.ndarray, kg: int) -> np.ndarray:
    """The 16 words of k-group ``kg`` (k-group 0 for kg < 0, as the kernel's branch-free load)."""
    kg = max(kg, 0)
    return words[kg * T.KGROUP : (kg + 1) * T.KGROUP]


def _one_hot(words: np.ndarray, stride: int) -> np.ndarray:
    """The one-hot operand of lanes 4g + t, [..., lane, register] uint32, from ``words`` [..., 16
    or 32] holding entry 2t + h of b0 at 2t + h and of b1 at ``stride`` + 2t + h: each value half
    kept where its word's row in group is g (tspmm_one_hot), the lower entry in the low half."""
    w = words.astype(np.uint64)
    regs = np.zeros((*w.shape[:-1], 32, 2), dtype=np.uint32)
    for reg in range(2):
        for half in range(2):
            e = w[..., reg * stride + 2 * TQ + half]  # [..., lane]
            hit = T.word_rows(e) == G.astype(np.uint64)
            regs[..., reg] |= (np.where(hit, e >> 16, 0) << (16 * half)).astype(np.uint32)
    return regs


def fragments(kg_ptr, words: np.ndarray) -> np.ndarray:
    """``tiled_spmm_fragments``: per k-group and lane 4g + t the one-hot operand (b0, b1) as uint32
    pairs, [k-group][lane][register]: b0's low half the value of entry 2t where its row in group
    is g (else zero), its high half entry 2t + 1's; b1 the same of entries 2t + 8, 2t + 9."""
    n = int(kg_ptr[-1])
    frags = np.zeros((max(n, 1), 32, 2), dtype=np.uint32)
    frags[:n] = _one_hot(words[: n * T.KGROUP].reshape(n, T.KGROUP), 8)
    return frags


def shuffled_operand(mine: np.ndarray) -> np.ndarray:
    """The one-hot operand as the shuffle version builds it, [lane][register] uint32: lane l's
    own word is ``mine[l]`` (entry (l / 16) * 8 + l % 8); lane 4g + t takes the words of lanes 2t,
    2t + 1 (b0) and 2t + 16, 2t + 17 (b1) and keeps each value half whose row in group is g."""
    return _one_hot(mine, 16)


def sequence_heads(lo: list[int], hi: list[int], tail1: int, tail2: int) -> tuple[int, int]:
    """The first two k-groups of the sequence ranges [lo[i], hi[i]) in turn, then (tail1, tail2):
    the kernel's from1 / from2 (-1: none)."""
    first, second = tail1, tail2
    for a, z in zip(reversed(lo), reversed(hi), strict=True):
        n = z - a
        first, second = (a if n > 0 else first), (a + 1 if n > 1 else (first if n == 1 else second))
    return first, second


def emulate(
    kg_ptr,
    words,
    n_chunks: int,
    m: int,
    b: np.ndarray,
    b2=None,
    group_map=None,
    warps: int = 16,
    operand: str = "fragments",
) -> np.ndarray:
    """The kernel's sums (float64, before rounding) for an ``m``-row A packed as given (``words``:
    the pack's word arrays; with ``b2`` the dual form, A2's words the second array; with
    ``group_map`` the row groups in the slots it names), with ``warps`` warps of 64 / warps row
    groups per block and the one-hot ``operand`` loaded ("fragments") or shuffled from the words
    ("shuffles"; "prefetched" is the same, its L1 prefetch of the next chunk's words a hint that
    changes no value), lane by lane: its ldmatrix addresses into swizzled stages, its one-hot
    registers, the MMAs and the epilogue's exchange of lanes g and g ^ 1 and 4-byte pair stores."""
    n = b.shape[1]
    out = np.full((m, n), np.nan)
    entry, piece = (LANES >> 4) * 8 + (LANES & 7), (LANES >> 3) & 1
    frags = [fragments(kg_ptr, w) for w in words]
    n_groups = -(-m // T.GROUP)
    wg = T.ROWS // T.GROUP // warps  # row groups per warp
    if operand not in T.OPERANDS:
        raise ValueError(f"operand: expected one of {T.OPERANDS}, got {operand!r}")

    def actual(slot: int) -> int:  # the kernel's actual(): the slot's row group, or -1
        grp = slot if group_map is None else (int(group_map[slot]) if slot < len(group_map) else -1)
        return grp if grp < n_groups else -1

    chunks = n_chunks * (1 if b2 is None else 2)

    def ranges(by: int, warp: int, c: int) -> tuple[list[int], list[int]]:
        """Warp ``warp``'s k-group ranges in row block ``by`` at chunk c (empty past the groups or
        the chunks)."""
        lo, hi = [0] * wg, [0] * wg
        for i in range(wg):
            grp = actual(by * T.ROWS // T.GROUP + warp * wg + i)
            if grp >= 0 and c < chunks:
                item = grp * n_chunks + c % n_chunks
                lo[i], hi[i] = int(kg_ptr[item]), int(kg_ptr[item + 1])
        return lo, hi

    rows = m if group_map is None else max(m, T.GROUP * len(group_map))
    for by in range(-(-rows // T.ROWS)):
        for bx in range(-(-n // T.COLS)):
            col0 = bx * T.COLS
            acc = np.zeros((warps, wg, 4, 32, 4))  # [warp][group][column step][lane][d]
            carried: dict[int, tuple] = {}  # per warp: the words in hand from the previous chunk
            for c in range(chunks):
                source, chunk_words = (b, words[0]) if c < n_chunks else (b2, words[1])
                stage = _staged(source, (c % n_chunks) * T.CHUNK, col0)
                for warp in range(warps):
                    # The warp's ranges and the kernel's prefetch: the words in hand are always
                    # those of the next two k-groups in (chunk, group, k-group) order, across the
                    # chunks of one words array; from1[i] / from2[i]: the first two k-groups of the
                    # sequence from group i on (from1[wg] / from2[wg]: the next chunk's first two,
                    # -1 at the tile's last chunk and before the dual form's switch to A2's words).
                    lo, hi = ranges(by, warp, c)
                    crosses = c + 1 < chunks and c + 1 != n_chunks
                    nlo, nhi = ranges(by, warp, c + 1)
                    from1, from2 = [-1] * (wg + 1), [-1] * (wg + 1)
                    if crosses:
                        from1[wg], from2[wg] = sequence_heads(nlo, nhi, -1, -1)
                    for i in range(wg - 1, -1, -1):
                        from1[i], from2[i] = sequence_heads(lo[i : i + 1], hi[i : i + 1], from1[i + 1], from2[i + 1])
                    # Each lane loads its own word (entry `entry`) of a k-group and its one-hot
                    # operand: the fragments, or (shuffles) built from the words of lanes 2t,
                    # 2t + 1, 2t + 16, 2t + 17. At a chunk's start both come from the previous
                    # chunk's prefetch where it ran on into this one.
                    chunk_frags = frags[0] if c < n_chunks else frags[1]

                    def load(kg: int, chunk_words=chunk_words, chunk_frags=chunk_frags) -> tuple:
                        mine = _kgroup(chunk_words, kg)[entry]
                        return mine, chunk_frags[max(kg, 0)] if operand == "fragments" else shuffled_operand(mine)

                    cur, nxt = carried.pop(warp) if warp in carried else (load(from1[0]), load(from2[0]))
                    for i in range(wg):
                        for kg in range(lo[i], hi[i]):
                            ahead = kg + 2 if kg + 2 < hi[i] else (from1[i + 1] if kg + 2 == hi[i] else from2[i + 1])
                            after = load(ahead)
                            mine, b_bits = cur[0].astype(np.int64), cur[1]
                            b_regs = np.stack(
                                [
                                    _value((b_bits[:, reg] >> (16 * h)) & 0xFFFF, source.dtype)
                                    for reg in range(2)
                                    for h in range(2)
                                ],
                                axis=1,
                            ).reshape(32, 2, 2)
                            address0 = ((mine ^ piece) & 0xFFF) << 4  # tspmm_row_address (stage offset)
                            for j in range(4):
                                address = address0 ^ (j << 5)
                                regs = _ldmatrix_x4_trans(stage, address >> 7, (address >> 4) & 7)
                                acc[warp, i, j] += _mma_m16n8k16(regs, b_regs)
                            cur, nxt = nxt, after
                    if crosses and from2[wg] >= 0:  # the next chunk's first two, where it holds both
                        carried[warp] = (cur, nxt)
            odd = (G & 1) == 1
            for warp in range(warps):
                for i in range(wg):
                    grp = actual(by * T.ROWS // T.GROUP + warp * wg + i)
                    row = grp * T.GROUP + 2 * TQ + odd if grp >= 0 else np.full(32, m)
                    for j in range(4):
                        for h in range(2):
                            d = acc[warp, i, j][:, 2 * h : 2 * h + 2]
                            sent = np.where(odd, d[:, 0], d[:, 1])
                            got = sent[LANES ^ 4]  # __shfl_xor_sync(..., 4): lane g ^ 1, same t
                            v0, v1 = np.where(odd, got, d[:, 0]), np.where(odd, d[:, 1], got)
                            col = col0 + 16 * j + 8 * h + (G & ~1)
                            for lane in range(32):
                                if row[lane] < m and col[lane] < n:
                                    out[row[lane], col[lane]] = v0[lane]
                                    if col[lane] + 1 < n:
                                        out[row[lane], col[lane] + 1] = v1[lane]
    return out


def fixup(out, kg_ptr, words, n_chunks: int, b: np.ndarray, b2=None) -> np.ndarray:
    """``tiled_spmm_fixup`` on the emulated sums: every row with a non-finite value recomputed
    from its own words only (each word of the row, padding skipped by its mark, times its own B
    row, in float64 here), as the kernel does after the product."""
    out = out.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        for row in np.flatnonzero(~np.isfinite(out).all(axis=1)):
            acc = np.zeros(out.shape[1])
            for c in range(n_chunks * (1 if b2 is None else 2)):
                source, chunk_words = (b, words[0]) if c < n_chunks else (b2, words[1])
                item = (row // T.GROUP) * n_chunks + c % n_chunks
                for w in chunk_words[int(kg_ptr[item]) * T.KGROUP : int(kg_ptr[item + 1]) * T.KGROUP].astype(np.int64):
                    if T.word_rows(w) != row % T.GROUP or w & T.PAD_BIT:
                        continue
                    b_row = (c % n_chunks) * T.CHUNK + T.word_b_rows(w)
                    acc += _value(np.array([w >> 16]), source.dtype)[0] * source[b_row].astype(np.float64)
            out[row] = acc
    return out


def _staged_64(rows: np.ndarray, r0: int, c0: int, n_rows: int) -> np.ndarray:
    """``n_rows`` rows from r0 and 32 columns from c0 of a matrix (zeros past its edges) as TMA
    writes them with the 64-byte swizzle: 16-byte piece p of row r stored at p ^ ((r // 2) % 4)."""
    logical = np.zeros((n_rows, 32))
    part = rows[r0 : r0 + n_rows, c0 : c0 + 32].astype(np.float64)
    logical[: part.shape[0], : part.shape[1]] = part
    physical = np.empty_like(logical)
    for r in range(n_rows):
        for p in range(4):
            q = p ^ ((r // 2) % 4)
            physical[r, 8 * q : 8 * q + 8] = logical[r, 8 * p : 8 * p + 8]
    return physical


def _ldmatrix_x4(stage: np.ndarray, rows: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4.b16 (PTX ISA): lanes 8i .. 8i + 7 address matrix i's rows; lane
    4g + t receives in register i the elements (row g, columns 2t and 2t + 1)."""
    fetched = np.stack([stage[rows[lane], 8 * pieces[lane] : 8 * pieces[lane] + 8] for lane in range(32)])
    regs = np.empty((32, 4, 2))
    for i in range(4):
        regs[:, i, 0] = fetched[8 * i + G, 2 * TQ]
        regs[:, i, 1] = fetched[8 * i + G, 2 * TQ + 1]
    return regs


def emulate_gated_up(
    kg_ptr, words, n_chunks: int, m: int, x: np.ndarray, w_up: np.ndarray, backward=None
) -> np.ndarray | tuple:
    """The words ``twell_tiled_ffn_up`` writes (h = g * u in the value bits, u and h rounded to
    x's dtype; zero-valued words keep value zero), lane by lane: the block's k-groups dealt to
    the warps in rounds, ldmatrix (x4, no .trans) of the swizzled W_up and x slices, the x
    fragment reloaded where the group changes, two MMAs per slice, and the lane with t = row / 2
    writing each entry.

    ``backward = (dests, u_data, u_spill, g_shape)``: the BACKWARD form (``x`` is dy, ``w_up``
    is W_down^T): with d_h the rounded sum, returns the d_z and d_u words and the (d_z, d_u, h)
    values at each word's place in the gate's layout (slots of ``g_shape``, and the spill), as
    the fused row-gather kernel rounds them (fp32 products of rounded operands, the first
    factor's -0 as +0); padding words keep value zero."""
    dtype = x.dtype
    d = x.shape[1]
    out = np.zeros_like(words)
    out2 = np.zeros_like(words)
    if backward is not None:
        dests, u_data, u_spill, g_shape = backward
        layouts = [(np.zeros(g_shape, dtype=dtype), np.zeros(u_spill.shape, dtype=dtype)) for _ in range(3)]

    def bits_of(v) -> int:
        return int(np.array([v], dtype=dtype).view(np.uint16)[0])

    def times(a, b):  # the fused kernel's product: fp32 of rounded operands, -0 as +0 first
        return dtype.type(np.float32(a if a != 0 else 0.0) * np.float32(b))

    a_entry, a_piece = (LANES & 7) + ((LANES >> 3) & 1) * 8, LANES >> 4
    n_groups = -(-m // T.GROUP)
    for by in range(-(-m // T.ROWS)):
        tok0, grp0 = by * T.ROWS, by * T.ROWS // T.GROUP
        for chunk in range(n_chunks):
            first, counts = [], []
            for i in range(64):
                grp = grp0 + i
                lo = int(kg_ptr[grp * n_chunks + chunk]) if grp < n_groups else 0
                first.append(lo)
                counts.append(int(kg_ptr[grp * n_chunks + chunk + 1]) - lo if grp < n_groups else 0)
            before = np.concatenate([[0], np.cumsum(counts)])
            total = int(before[-1])
            for r0 in range(0, total, 16 * 16):
                n = min(256, total - r0)
                for warp in range(16):
                    lo, cnt = r0 + warp * n // 16, r0 + (warp + 1) * n // 16 - (r0 + warp * n // 16)
                    groups = [int(np.searchsorted(before, q, side="right") - 1) for q in range(lo, lo + cnt)]
                    queue = zip(groups, range(lo, lo + cnt), strict=True)
                    kgs = [first[grp] + q - int(before[grp]) for grp, q in queue]
                    acc = np.zeros((cnt, 32, 4))
                    for s in range(-(-d // 32)):
                        w_stage = _staged_64(w_up, chunk * T.CHUNK, 32 * s, T.CHUNK)
                        x_stage = _staged_64(x, tok0, 32 * s, T.ROWS)
                        xf = None
                        for i, (grp, kg) in enumerate(zip(groups, kgs, strict=True)):
                            if i == 0 or grp != groups[i - 1]:
                                x_rows = grp * 8 + (LANES & 7)
                                xf = _ldmatrix_x4(x_stage, x_rows, (LANES >> 3) ^ ((LANES & 7) >> 1))
                            unit = T.word_b_rows(words[kg * 16 + a_entry].astype(np.int64))
                            for half in range(2):
                                pieces = (2 * half + a_piece) ^ ((unit >> 1) & 3)
                                a = _ldmatrix_x4(w_stage, unit, pieces)
                                acc[i] += _mma_m16n8k16(a, xf[:, 2 * half : 2 * half + 2])
                    for i, kg in enumerate(kgs):
                        for lane in range(32):
                            g, t = G[lane], TQ[lane]
                            for half in range(2):
                                at = kg * 16 + g + 8 * half
                                w = int(words[at])
                                row = T.word_rows(w)
                                if row >> 1 != t:
                                    continue
                                dot = np.float64(dtype.type(acc[i, lane, 2 * half + (row & 1)]))
                                gv = _value(np.array([w >> 16]), dtype)[0]
                                pad = bool(w & T.PAD_BIT)
                                if backward is None:
                                    h = dtype.type(0) if pad else dtype.type(np.float32(gv) * np.float32(dot))
                                    out[at] = bits_of(h) << 16 | (w & 0xFFFF)
                                    continue
                                dest = int(dests[at])
                                u = 0.0 if pad else float(u_data.reshape(-1)[dest] if dest >= 0 else u_spill[~dest])
                                dz = dtype.type(0) if pad else times(dot, u)
                                du = dtype.type(0) if pad else times(dot, gv)
                                out[at] = bits_of(dz) << 16 | (w & 0xFFFF)
                                out2[at] = bits_of(du) << 16 | (w & 0xFFFF)
                                if not pad:
                                    for (data, spill), v in zip(layouts, (dz, du, times(gv, u)), strict=True):
                                        if dest >= 0:
                                            data.reshape(-1)[dest] = v
                                        else:
                                            spill[~dest] = v
    return out if backward is None else (out, out2, layouts)


def emulate_pack_transposed(parts, tile_n: int, n_cols: int) -> tuple[np.ndarray, list[np.ndarray], int]:
    """``tiled_spmm_count_t`` / ``tiled_spmm_place_t`` as the kernels compute them, block by block
    (512 tokens x 512 columns): the bit matrix [column][token] of the block's entries, class
    counts by popcounts under the masks 0x01010101 << q, each entry's rank as its group's earlier
    columns' counts plus its column's class bits below its token, the octet plan's position, then
    the padding (:func:`padding_sources`)."""
    m = parts.data.shape[0]
    n_chunks = -(-m // T.CHUNK)
    n_groups = -(-n_cols // T.GROUP)
    rows = _entries_by_row(parts, tile_n)
    popc = np.vectorize(lambda v: bin(int(v)).count("1"))
    blocks = []
    sizes = np.zeros(n_groups * n_chunks, dtype=np.int64)
    for bx in range(-(-n_cols // 512)):
        for by in range(n_chunks):
            c0, c1 = bx * 512, min(n_cols, bx * 512 + 512)
            bits = np.zeros((512, 16), dtype=np.uint64)
            mine = []
            for lt in range(512):
                token = by * 512 + lt
                if token >= m:
                    continue
                for col, source in rows[token]:
                    if c0 <= col < c1:
                        bits[col - c0, lt >> 5] |= np.uint64(1 << (lt & 31))
                        mine.append((lt, col, source))
            masks = [np.uint64(0x01010101 << q) for q in range(8)]
            count = np.stack([popc(bits & masks[q]).sum(axis=1) for q in range(8)], axis=1)  # [column][class]
            total = count.reshape(64, 8, 8).sum(axis=1)  # [group][class]
            plans = [octet_places(total[gi]) for gi in range(64)]
            for gi in range(64):
                if c0 + 8 * gi < c1:
                    sizes[(c0 // 8 + gi) * n_chunks + by] = plans[gi][1] // 2
            blocks.append((c0, c1, by, mine, bits, count, total, plans))
    kg_ptr = np.concatenate([[0], np.cumsum(sizes)])
    words = np.zeros(int(kg_ptr[-1]) * T.KGROUP, dtype=np.uint32)
    for c0, c1, by, mine, bits, count, _, plans in blocks:
        filled = {}
        for lt, col, source in mine:
            u, q = col - c0, lt & 7
            gi = u >> 3
            k = int(count[gi * 8 : u, q].sum())
            k += sum(bin(int(bits[u, w]) & (0x01010101 << q)).count("1") for w in range(lt >> 5))
            k += bin(int(bits[u, lt >> 5]) & (0x01010101 << q) & ((1 << (lt & 31)) - 1)).count("1")
            p = plans[gi][0][(q, k)]
            at = int(kg_ptr[(c0 // 8 + gi) * n_chunks + by]) * T.KGROUP
            words[at + p] = T.word(_value_bits((parts.data, parts.spill_data), source), u & 7, lt)
            filled.setdefault(gi, set()).add(p)
        for gi in range(64):
            if c0 + 8 * gi < c1:
                at = int(kg_ptr[(c0 // 8 + gi) * n_chunks + by]) * T.KGROUP
                positions = 8 * plans[gi][1]
                sources = padding_sources([p in filled.get(gi, ()) for p in range(positions)])
                for p, src in enumerate(sources):
                    if src is not None:
                        words[at + p] = words[at + src] & 0xFFFF | T.PAD_BIT
    return kg_ptr, [words], n_chunks


def balance(kg_ptr, n_chunks: int, m: int, warps: int = 16) -> np.ndarray:
    """``tiled_spmm_balance``'s map for a product of ``warps`` warps per block: each group's load
    (its k-groups over all chunks), its rank (heavier first, ties by index), rank r to block r %
    B, then pass (r // B) // warps and warp (r // B) % warps (odd passes reversed), slot (block *
    warps + warp) * (64 // warps) + pass; -1 in the slots no group takes."""
    n_groups = -(-m // T.GROUP)
    blocks = -(-n_groups // 64)
    load = np.asarray(kg_ptr[n_chunks : (n_groups + 1) * n_chunks : n_chunks]) - np.asarray(
        kg_ptr[: n_groups * n_chunks : n_chunks]
    )
    index = np.arange(n_groups)
    heavier = (load[None, :] > load[:, None]) | ((load[None, :] == load[:, None]) & (index[None, :] < index[:, None]))
    ranks = heavier.sum(axis=1)  # [j]: the groups i that come before j
    group_map = np.full(64 * blocks, -1, dtype=np.int64)
    for j, rank in enumerate(ranks.tolist()):
        block, (passes, pos) = rank % blocks, divmod(rank // blocks, warps)
        warp = warps - 1 - pos if passes % 2 else pos
        group_map[(block * warps + warp) * (64 // warps) + passes] = j
    return group_map
