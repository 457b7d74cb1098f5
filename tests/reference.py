"""NumPy references of the compressed allreduce algorithms over all ranks' inputs.

Written from the papers (Shi et al. 2019 Alg. 1-4) and DESIGN.md §4: magnitude ties break
toward the lower index; P need not be a power of two (extra ranks fold into the first ones).
"""

from __future__ import annotations

import numpy as np


def topk_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |acc|, ties toward lower index, ascending."""
    order = np.lexsort((np.arange(acc.size), -np.abs(acc.astype(np.float64))))
    return np.sort(order[:k])


def local_topk(x: np.ndarray, residual: np.ndarray, k: int):
    acc = (x + residual).astype(np.float32)
    idx = topk_indices(acc, k)
    new_residual = acc.copy()
    new_residual[idx] = 0
    return idx, acc[idx], new_residual


def topk_allgather(xs: list[np.ndarray], residuals: list[np.ndarray], k: int):
    """TopKAllReduce: sum of every rank's local top-k, summed in rank order."""
    n = xs[0].size
    summed = np.zeros(n, np.float32)
    new_residuals = []
    for x, r in zip(xs, residuals, strict=True):
        idx, val, new_r = local_topk(x, r, k)
        np.add.at(summed, idx, val)
        new_residuals.append(new_r)
    return summed, new_residuals


def merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int):
    """The ⊤ operator: top-k by magnitude of the sum of two sparse sets; also returns drops."""
    union = np.union1d(a[0], b[0])
    values = np.zeros(union.size, np.float32)
    ia = np.searchsorted(union, a[0])
    ib = np.searchsorted(union, b[0])
    va = np.zeros(union.size, np.float32)
    vb = np.zeros(union.size, np.float32)
    va[ia] = a[1]
    vb[ib] = b[1]
    in_a = np.zeros(union.size, bool)
    in_a[ia] = True
    in_b = np.zeros(union.size, bool)
    in_b[ib] = True
    values = np.where(in_a & in_b, va + vb, np.where(in_a, va, vb)).astype(np.float32)
    keep = np.sort(np.lexsort((union, -np.abs(values.astype(np.float64))))[:k])
    dropped = np.setdiff1d(np.arange(union.size), keep)
    return (union[keep], values[keep]), (union[dropped], values[dropped])


def gtopk(xs: list[np.ndarray], residuals: list[np.ndarray], k: int):
    """gTop-k allreduce with exact conservation (see ffi/gtopk.cc)."""
    p = len(xs)
    n = xs[0].size
    local = [local_topk(x, r, k) for x, r in zip(xs, residuals, strict=True)]
    sets = {rank: (local[rank][0], local[rank][1]) for rank in range(p)}
    drops: dict[int, list] = {rank: [] for rank in range(p)}
    p2 = 1
    while p2 * 2 <= p:
        p2 *= 2
    for rank in range(p2, p):  # fold
        sets[rank - p2], dropped = merge(sets[rank - p2], sets[rank], k)
        drops[rank - p2].append(dropped)
    d = 1
    while d < p2:
        for rank in range(0, p2, 2 * d):
            sets[rank], dropped = merge(sets[rank], sets[rank + d], k)
            drops[rank].append(dropped)
        d *= 2
    global_idx, global_val = sets[0]
    summed = np.zeros(n, np.float32)
    summed[global_idx] = global_val
    new_residuals = []
    for rank in range(p):
        new_r = local[rank][2].copy()
        idx, val = local[rank][0], local[rank][1]
        outside = ~np.isin(idx, global_idx)
        new_r[idx[outside]] += val[outside]
        for d_idx, d_val in drops[rank]:
            inside = np.isin(d_idx, global_idx)
            new_r[d_idx[inside]] += d_val[inside]
        new_residuals.append(new_r)
    return summed, new_residuals
