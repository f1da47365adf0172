"""Vectorised interval arithmetic per group: the core every time-based analyzer uses.

Intervals come as flat numpy arrays (group id, set id, start, end). ``measure`` answers questions such as
"how long was set A covered and set B not, in each group" for any boolean combination of sets, with one sort of
the 2N interval endpoints and a cumulative sum per set -- no Python loop over intervals. Overlapping intervals of
the same set count once (the union), which is how docs/metrics.md merges compute and communication intervals before
intersecting them (HTA ``get_comm_comp_overlap``; dtprof overlap definition).

``assign_to_windows`` maps intervals onto per-key windows (a rank's steps) with one ``searchsorted``.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

_INT64_SAFE = 2**62


def measure(group: np.ndarray, set_id: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int,
            n_sets: int, exprs: Mapping[str, Callable[[list], np.ndarray]]) -> dict[str, np.ndarray]:
    """Length (same unit as start/end) per group of the time where each expression of set coverage holds.

    ``exprs`` maps a name to a function receiving ``covered``: a list, one boolean array per set, telling whether
    that set covers the elementary segment; e.g. ``{"overlap": lambda c: c[0] & c[2] & ~c[1]}``.
    Returns ``{name: float64 array of length n_groups}``. Zero- or negative-length intervals are ignored.
    """
    out = {name: np.zeros(n_groups, dtype=np.float64) for name in exprs}
    gg, seg, covered = coverage_segments(group, set_id, start, end, n_sets)
    if len(seg) == 0:
        return out
    for name, fn in exprs.items():
        mask = fn(covered)
        out[name] = np.bincount(gg[mask], weights=seg[mask].astype(np.float64), minlength=n_groups)
    return out


def coverage_segments(group: np.ndarray, set_id: np.ndarray, start: np.ndarray, end: np.ndarray,
                      n_sets: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The elementary segments of every group's time line between consecutive interval endpoints.

    Returns ``(group, length, covered)`` for the segments of non-zero length: ``covered[k]`` tells whether set
    ``k`` covers the segment. Overlapping intervals of one set count once. Zero- or negative-length intervals are
    ignored. One sort of the 2N endpoints and a cumulative sum per set.
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    keep = end > start
    g = np.asarray(group, dtype=np.int64)[keep]
    sid = np.asarray(set_id, dtype=np.int16)[keep]
    s, e = start[keep], end[keep]
    if len(s) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), [np.zeros(0, bool) for _ in range(n_sets)]
    n = len(s)
    t = np.concatenate([s, e])
    del s, e
    gg = np.concatenate([g, g])
    # set id and direction in one small code: 2*set + 1 for a start, 2*set for an end
    code = np.concatenate([sid * 2 + 1, sid * 2])
    tmin, tmax = int(t.min()), int(t.max())
    span = tmax - tmin + 1
    if (int(gg.max()) + 1) * span < _INT64_SAFE:
        key = gg * span + (t - tmin)
        del t, gg
        order = np.argsort(key, kind="stable")
        key = key[order]
        gg, t = np.divmod(key, span)
        del key
    else:
        order = np.lexsort((t, gg))
        t, gg = t[order], gg[order]
    code = code[order]
    del order
    delta = np.where(code & 1, np.int8(1), np.int8(-1))
    setk = code >> 1
    # Each group's +1/-1 sum to zero, so one running sum over all groups restarts correctly at each group.
    covered = []
    for k in range(n_sets):
        covered.append(np.cumsum(np.where(setk == k, delta, np.int8(0)), dtype=np.int32) > 0)
    del delta, setk, code
    seg = np.zeros(2 * n, dtype=np.int64)
    seg[:-1] = t[1:] - t[:-1]
    seg[:-1][gg[1:] != gg[:-1]] = 0
    nonzero = seg > 0
    return gg[nonzero], seg[nonzero], [c[nonzero] for c in covered]


def union_length(group: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int) -> np.ndarray:
    """|union of the intervals| per group."""
    return measure(group, np.zeros(len(start), np.int8), start, end, n_groups, 1, {"u": lambda c: c[0]})["u"]


def assign_to_windows(win_key: np.ndarray, win_start: np.ndarray, win_end: np.ndarray,
                      key: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Row index of the window holding time ``t`` for each item (same ``key``), -1 where none does.

    Windows must not overlap within a key. ``win_key``/``key`` are small non-negative ints (e.g. rank).
    """
    win_key = np.asarray(win_key, np.int64)
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    key = np.asarray(key, np.int64)
    t = np.asarray(t, np.int64)
    if len(win_start) == 0 or len(t) == 0:
        return np.full(len(t), -1, dtype=np.int64)
    tmin = min(int(win_start.min()), int(t.min()))
    span = max(int(win_end.max()), int(t.max())) - tmin + 1
    kmax = max(int(win_key.max()), int(key.max())) + 1
    if kmax * span < _INT64_SAFE:
        wk = win_key * span + (win_start - tmin)
        order = np.argsort(wk, kind="stable")
        pos = np.searchsorted(wk[order], key * span + (t - tmin), side="right") - 1
    else:  # very long runs with many keys: sort by (key, start) and search per key boundary
        order = np.lexsort((win_start, win_key))
        sk, ss = win_key[order], win_start[order]
        lo = np.searchsorted(sk, key, side="left")
        hi = np.searchsorted(sk, key, side="right")
        pos = np.empty(len(t), np.int64)
        for k in np.unique(key):  # one loop per key (rank), not per item
            m = key == k
            a, b = lo[m][0], hi[m][0]
            pos[m] = a + np.searchsorted(ss[a:b], t[m], side="right") - 1
    pos = np.clip(pos, -1, len(order) - 1)
    idx = np.where(pos >= 0, order[np.maximum(pos, 0)], -1)
    ok = (idx >= 0)
    ok &= win_key[np.maximum(idx, 0)] == key
    ok &= t < win_end[np.maximum(idx, 0)]
    ok &= t >= win_start[np.maximum(idx, 0)]
    return np.where(ok, idx, -1)


def _key_blocks(win_key: np.ndarray, win_start: np.ndarray, win_end: np.ndarray, key: np.ndarray):
    """The windows sorted by (key, start) -- ``order``, their starts and ends in that order -- and, one pass per key
    of ``key`` (a rank), not per interval: the mask of its intervals and the block [a, b) of its windows."""
    order = np.lexsort((win_start, win_key))
    wk = win_key[order]
    lo_k = np.searchsorted(wk, key, side="left")
    hi_k = np.searchsorted(wk, key, side="right")
    blocks = []
    for k in np.unique(key):
        m = key == k
        blocks.append((m, int(lo_k[m][0]), int(hi_k[m][0])))
    return order, win_start[order], win_end[order], blocks


def split_over_windows(win_key: np.ndarray, win_start: np.ndarray, win_end: np.ndarray,
                       key: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Each interval cut into its pieces inside the windows of the same key (a rank's steps) it overlaps.

    Returns ``(item, window, start, end)``, one row per piece: the interval's index, the window's row index and the
    piece's clipped bounds. Parts outside every window are dropped. Windows must not overlap within a key.
    """
    win_key = np.asarray(win_key, np.int64)
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    key = np.asarray(key, np.int64)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    empty = np.zeros(0, np.int64)
    if len(win_start) == 0 or len(start) == 0:
        return empty, empty, empty, empty
    # windows sorted by (key, start) also have sorted ends within a key; search within each key's block
    order, ws, we, blocks = _key_blocks(win_key, win_start, win_end, key)
    first = np.empty(len(start), np.int64)
    last = np.empty(len(start), np.int64)
    for m, a, b in blocks:
        first[m] = a + np.searchsorted(we[a:b], start[m], side="right")      # first window ending after start
        last[m] = a + np.searchsorted(ws[a:b], end[m], side="left") - 1     # last window starting before end
    n = np.maximum(last - first + 1, 0)
    item = np.repeat(np.arange(len(start)), n)
    offset = np.arange(len(item)) - np.repeat(np.cumsum(n) - n, n)
    pos = np.repeat(first, n) + offset
    s = np.maximum(start[item], ws[pos])
    e = np.minimum(end[item], we[pos])
    keep = e > s
    return item[keep], order[pos[keep]], s[keep], e[keep]


def windows_touched(win_key: np.ndarray, win_start: np.ndarray, win_end: np.ndarray,
                    key: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per window, whether one of the intervals [lo, hi] of the same key meets it (ends included): a superset of the
    windows that ``assign_to_windows`` gives any time in them and that ``split_over_windows`` gives a piece of them.
    A window met by nothing holds nothing a per-window measure could count."""
    win_key = np.asarray(win_key, np.int64)
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    key = np.asarray(key, np.int64)
    lo = np.asarray(lo, np.int64)
    hi = np.asarray(hi, np.int64)
    n = len(win_start)
    if n == 0 or len(lo) == 0:
        return np.zeros(n, bool)
    order, ws, we, blocks = _key_blocks(win_key, win_start, win_end, key)
    first = np.zeros(len(lo), np.int64)
    last = np.zeros(len(lo), np.int64)
    for m, a, b in blocks:
        reach = np.maximum.accumulate(we[a:b])   # the latest end so far: windows need not be sorted by end
        first[m] = a + np.searchsorted(reach, lo[m], side="left")     # first window that may end at or after lo
        last[m] = a + np.searchsorted(ws[a:b], hi[m], side="right")   # past the last window starting by hi
    ok = first < last
    runs = np.cumsum(np.bincount(first[ok], minlength=n + 1) - np.bincount(last[ok], minlength=n + 1))[:n]
    out = np.zeros(n, bool)
    out[order] = runs > 0
    return out


def _sorted_distinct(x: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique is several times slower on millions of int64)."""
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]] if len(x) else x


def innermost(group: np.ndarray, set_id: np.ndarray, start: np.ndarray, end: np.ndarray):
    """The intervals flattened so that none overlap within a group: an instant covered by several sets goes to the
    set whose covering stretch began last -- the innermost one when intervals nest (Lightning runs forward and
    backward inside ``optimizer.step(closure)``). Intervals of one set are merged first (their union), so a set's
    stretch begins where its union block begins; at equal beginnings the stretch that ends first (the inner one)
    wins, then the lower set id.

    Returns ``(group, set_id, start, end)`` of disjoint intervals, sorted by group and start. Vectorised: times are
    replaced by their rank among all endpoints (so group * time fits an int64), one sort, one ``searchsorted`` per
    set; intervals that overlap nothing pass through untouched.
    """
    group = np.asarray(group, np.int64)
    set_id = np.asarray(set_id, np.int64)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    keep = end > start
    group, set_id, start, end = group[keep], set_id[keep], start[keep], end[keep]
    if len(start) == 0:
        return group, set_id, start, end
    times = _sorted_distinct(np.concatenate([start, end]))
    n_t = len(times)
    order = np.lexsort((start, group))
    group, set_id = group[order], set_id[order]
    s, e = np.searchsorted(times, start[order]), np.searchsorted(times, end[order])
    # clusters of overlapping intervals in (group, start) order; one of a single interval stays as it is
    reach = np.maximum.accumulate(group * n_t + e)
    opens = np.r_[True, group[1:] * n_t + s[1:] >= reach[:-1]]
    cluster = np.cumsum(opens)
    alone = np.bincount(cluster)[cluster] == 1
    if not alone.all():
        g2, k2, s2, e2 = _flatten(group[~alone], set_id[~alone], s[~alone], e[~alone], n_t)
        group, set_id = np.concatenate([group[alone], g2]), np.concatenate([set_id[alone], k2])
        s, e = np.concatenate([s[alone], s2]), np.concatenate([e[alone], e2])
        order = np.lexsort((s, group))
        group, set_id, s, e = group[order], set_id[order], s[order], e[order]
    return group, set_id, times[s], times[e]


def _flatten(group, set_id, s, e, n_t):
    """innermost() of overlapping intervals, on compressed times ``s``, ``e`` (< ``n_t``)."""
    sets = np.unique(set_id)
    # union blocks per (group, set): sorted by (group, set, start), a new block where a start passes every earlier
    # end of the same (group, set)
    gs = group * len(sets) + np.searchsorted(sets, set_id)
    order = np.lexsort((s, gs))
    gs, s, e = gs[order], s[order], e[order]
    reach = np.maximum.accumulate(gs * n_t + e)         # latest end so far, offset per (group, set)
    new = np.r_[True, gs[1:] * n_t + s[1:] > reach[:-1]]
    b_gs, b_s = gs[new], s[new]
    b_e = reach[np.r_[new[1:], True]] - b_gs * n_t
    b_group, b_set = b_gs // len(sets), b_gs % len(sets)
    # elementary segments between consecutive block endpoints of a group
    pts = _sorted_distinct(np.concatenate([b_group * n_t + b_s, b_group * n_t + b_e]))
    seg_g, seg_a = pts[:-1] // n_t, pts[:-1] % n_t
    seg_b = pts[1:] % n_t
    same = seg_g == pts[1:] // n_t
    seg_g, seg_a, seg_b = seg_g[same], seg_a[same], seg_b[same]
    best_k = np.full(len(seg_a), -1, np.int64)
    best_s = np.full(len(seg_a), -1, np.int64)
    best_e = np.full(len(seg_a), n_t, np.int64)
    for k in range(len(sets)):
        mine = b_set == k
        bkey = b_group[mine] * n_t + b_s[mine]            # sorted: blocks are in (group, set, start) order
        be = b_e[mine]
        pos = np.searchsorted(bkey, seg_g * n_t + seg_a, side="right") - 1
        p = np.maximum(pos, 0)
        b_start = bkey[p] - seg_g * n_t                   # every set has a block, so bkey is never empty
        cov = (pos >= 0) & (b_start >= 0) & (be[p] > seg_a)
        better = cov & ((b_start > best_s) | ((b_start == best_s) & (be[p] < best_e)))
        best_k = np.where(better, k, best_k)
        best_s = np.where(better, b_start, best_s)
        best_e = np.where(better, be[p], best_e)
    got = best_k >= 0
    seg_g, seg_k, seg_a, seg_b = seg_g[got], best_k[got], seg_a[got], seg_b[got]
    # adjacent segments of one set join into one interval
    first = np.r_[True, (seg_g[1:] != seg_g[:-1]) | (seg_k[1:] != seg_k[:-1]) | (seg_a[1:] != seg_b[:-1])]
    last = np.r_[first[1:], True]
    return seg_g[first], sets[seg_k[first]], seg_a[first], seg_b[last]
