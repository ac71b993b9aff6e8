"""Batching transforms: pure functions of sequence lengths that return index lists.

* :func:`micro_batches_by_token_budget` — first-fit decreasing packing of sequences into
  micro-batches of at most ``max_tokens`` tokens (dynamic batch size);
* :func:`micro_batches_by_padded_budget` — the same budget counted as a padded forward computes it
  (rows × the longest row), groups kept whole and filled longest first, so each micro-batch holds
  rows of similar length and can be cut to its own longest row (remove-padding by sorting);
* :func:`balanced_partition` — split sequences across ``k`` data-parallel ranks with balanced
  token counts by the Karmarkar–Karp largest-differencing method (as MindSpeed-RL's and verl's
  dynamic batch size do); ``equal_size=True`` also gives every rank the same number of sequences.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["micro_batches_by_token_budget", "micro_batches_by_padded_budget", "padded_cost", "balanced_partition",
           "partition_spread", "length_buckets"]


def _as_list(lengths) -> list[int]:
    out = [int(x) for x in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    if any(x < 0 for x in out):
        raise ValueError("lengths: must be non-negative token counts")
    return out


def micro_batches_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack sequence indices into micro-batches whose token sums are ``≤ max_tokens``.

    First-fit decreasing (≤ 11/9·OPT + 1 bins); each micro-batch lists indices in ascending
    order, micro-batches ordered by their first index. Every index appears exactly once.
    """
    lens = _as_list(lengths)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens}: must be > 0")
    too_long = [i for i, n in enumerate(lens) if n > max_tokens]
    if too_long:
        raise ValueError(f"lengths: sequence {too_long[0]} has {lens[too_long[0]]} tokens > max_tokens={max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        for b, r in enumerate(room):
            if lens[i] <= r:
                bins[b].append(i)
                room[b] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lens[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def padded_cost(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """What a right-padded forward over ``rows`` computes: ``len(rows) · max(lengths[rows])``."""
    lens = _as_list(lengths)
    return len(rows) * max((lens[i] for i in rows), default=0)


def micro_batches_by_padded_budget(lengths: Sequence[int], groups: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches whose padded cost (:func:`padded_cost`) is ``≤ max_tokens`` — a row longer than
    the budget alone in its own — keeping each group (rows with one ``groups`` id: the samples of a
    prompt, whose prompt a shared-prefix forward runs once) whole when it fits; a group that does not
    is split, longest rows first. Units are taken longest row first and appended to the current
    micro-batch while it stays within budget, so neighbours are similar in length and a micro-batch
    cut to its longest row carries little padding. Every index appears exactly once; indices ascend
    inside a micro-batch."""
    lens, gids = _as_list(lengths), [int(g) for g in (groups.tolist() if hasattr(groups, "tolist") else groups)]
    if len(gids) != len(lens):
        raise ValueError(f"groups: {len(gids)} ids for {len(lens)} lengths")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens}: must be > 0")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(gids):
        members.setdefault(g, []).append(i)
    units = [unit for rows in members.values()
             for unit in _chunks([[i] for i in sorted(rows, key=lambda i: (-lens[i], i))], lens, max_tokens)]
    units.sort(key=lambda rows: (-lens[rows[0]], rows[0]))  # a unit's first row is its longest
    return [sorted(mb) for mb in _chunks(units, lens, max_tokens)]


def _chunks(units: list[list[int]], lens: list[int], budget: int) -> list[list[int]]:
    """Consecutive units (row lists, by decreasing first-row length) merged while ``rows × the
    first row's length ≤ budget`` (a chunk holds at least one unit)."""
    out, cur = [], []
    for unit in units:
        width = lens[cur[0]] if cur else lens[unit[0]]
        if cur and (len(cur) + len(unit)) * width > budget:
            out.append(cur)
            cur = []
        cur.extend(unit)
    return out + ([cur] if cur else [])


def balanced_partition(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Karmarkar–Karp k-way partition of indices by token count. Returns ``k`` sorted index lists.

    Each state is ``k`` bins; the two states with the largest spread are merged by pairing the
    heaviest bins of one with the lightest of the other, until one state remains.
    ``equal_size`` seeds states from consecutive groups of ``k`` sorted items (one item per bin)
    so every bin ends with ``B/k`` items (requires ``B % k == 0``).
    """
    lens = _as_list(lengths)
    if k <= 0:
        raise ValueError(f"k={k}: must be ≥ 1")
    if equal_size and len(lens) % k:
        raise ValueError(f"equal_size: {len(lens)} sequences do not split evenly over k={k} ranks")
    order = sorted(range(len(lens)), key=lambda j: (lens[j], j))
    seeds = [order[s : s + k] for s in range(0, len(order), k)] if equal_size else [[i] for i in order]
    heap = []
    for n, seed in enumerate(seeds):
        bins = [(lens[i], [i]) for i in seed] + [(0, []) for _ in range(k - len(seed))]
        bins.sort(key=lambda b: -b[0])
        heapq.heappush(heap, (-(bins[0][0] - bins[-1][0]), n, bins))
    counter = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda x: -x[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    final = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return [sorted(items) for _, items in final]


def partition_spread(lengths: Sequence[int], parts: list[list[int]]) -> int:
    """Max minus min token sum over the parts."""
    lens = _as_list(lengths)
    sums = [sum(lens[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def length_buckets(lengths: Sequence[int], call_cost: int, max_buckets: int = 4) -> list[list[int]]:
    """Rows in at most ``max_buckets`` buckets of neighbouring lengths, each run as one right-padded call cut to
    its own longest row: the partition minimising ``Σ_buckets rows · max length + call_cost · (buckets − 1)`` —
    the tokens a padded forward computes plus a fixed cost (in tokens) of every call after the first. Exact
    dynamic programming over the sorted lengths, a bucket ending where the length changes (at most 64 such
    places considered, evenly spaced: near-optimal beyond). One bucket whenever no split can pay for a call
    (``n · max − Σ lengths ≤ call_cost``). Buckets in ascending length, indices ascending inside each; every
    index exactly once. E.g. lengths ``[1, 1, 1, 8]``, ``call_cost 10``: one bucket costs 32, two ``[1,1,1] | [8]``
    cost 3 + 8 + 10 = 21 → two."""
    lens = _as_list(lengths)
    if call_cost < 0 or max_buckets < 1:
        raise ValueError(f"length_buckets: call_cost={call_cost} must be ≥ 0 and max_buckets={max_buckets} ≥ 1")
    n = len(lens)
    if n == 0:
        return []
    if max_buckets == 1 or n * max(lens) - sum(lens) <= call_cost:
        return [list(range(n))]
    order = sorted(range(n), key=lens.__getitem__)
    c = [lens[i] for i in order]
    ends = [i for i in range(1, n) if c[i] != c[i - 1]]
    if len(ends) > 63:
        ends = [ends[round(k * (len(ends) - 1) / 62)] for k in range(63)]
    pts = [0, *sorted(set(ends)), n]
    m, inf = len(pts), float("inf")
    cost, back = [[0.0] + [inf] * (m - 1)], []  # cost[k][j]: rows [0, pts[j]) in k buckets
    for _ in range(max_buckets):
        prev, row, bk = cost[-1], [inf] * m, [0] * m
        for j in range(1, m):
            w = c[pts[j] - 1]
            for i in range(j):
                v = prev[i] + (pts[j] - pts[i]) * w
                if v < row[j]:
                    row[j], bk[j] = v, i
        cost.append(row)
        back.append(bk)
    k = min(range(1, max_buckets + 1), key=lambda k: (cost[k][m - 1] + call_cost * (k - 1), k))
    cuts, j = [], m - 1
    for kk in range(k, 0, -1):
        i = back[kk - 1][j]
        cuts.append((pts[i], pts[j]))
        j = i
    return [sorted(order[a:b]) for a, b in reversed(cuts)]
