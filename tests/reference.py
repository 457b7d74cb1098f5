"""NumPy references of the compressed allreduce algorithms over all ranks' inputs.

Written from the papers (Shi et al. 2019 Alg. 1-4) and docs/DESIGN.md §4: magnitude ties break
toward the lower index; P need not be a power of two (extra ranks fold into the first ones).
"""

from __future__ import annotations

import math

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


# ---- quantized allreduce (Dryden et al. 2016 §3.4) and hierarchical allreduce ------------


def onebit_quantize(acc: np.ndarray, column_size: int) -> np.ndarray:
    """Decoded one-bit encoding of float32 `acc` (exact column means of each sign)."""
    out = np.zeros_like(acc)
    for begin in range(0, acc.size, column_size):
        col = acc[begin : begin + column_size]
        nonneg, neg = col >= 0, col < 0
        m_pos = np.float32(col[nonneg].astype(np.float64).mean()) if nonneg.any() else np.float32(0)
        m_neg = np.float32(col[neg].astype(np.float64).mean()) if neg.any() else np.float32(0)
        out[begin : begin + column_size] = np.where(nonneg, m_pos, m_neg)
    return out


def threshold_quantize(acc: np.ndarray, tau: float, max_density: float) -> np.ndarray:
    """Decoded threshold encoding: +-tau where |acc| > tau, lowest indices up to capacity."""
    tau = np.float32(tau)
    capacity = min(acc.size, max(1, math.ceil(max_density * acc.size)))
    sent = np.flatnonzero((acc > tau) | (acc < -tau))[:capacity]
    out = np.zeros_like(acc)
    out[sent] = np.where(acc[sent] > tau, tau, -tau)
    return out


def adaptive_keep(count: int, zeros: int, proportion: float) -> int:
    """Values of one sign a column sends: Dryden et al. §3.3 send the largest k/π of the k
    non-negative (mirrored: non-positive) values; zeros count toward k but are never sent."""
    return min(count, math.ceil((count + zeros) / proportion))


def adaptive_quantize(acc: np.ndarray, proportion: float, column_size: int) -> np.ndarray:
    """Decoded adaptive encoding (exact mode): per column, the adaptive_keep largest of each
    sign, each decoded to the mean of the sent values of its sign."""
    out = np.zeros_like(acc)
    for begin in range(0, acc.size, column_size):
        col = acc[begin : begin + column_size]
        pos = np.flatnonzero(col > 0)
        neg = np.flatnonzero(col < 0)
        zeros = col.size - pos.size - neg.size
        pos = pos[
            np.argsort(-col[pos], kind="stable")[: adaptive_keep(pos.size, zeros, proportion)]
        ]
        neg = neg[np.argsort(col[neg], kind="stable")[: adaptive_keep(neg.size, zeros, proportion)]]
        for chosen in (pos, neg):
            if chosen.size:
                out[begin + chosen] = np.float32(col[chosen].astype(np.float64).mean())
    return out


_U32 = np.uint32


def blockquant_hash(x):
    """kernels/blockquant.h BlockQuantHash (lowbias32) on uint32 scalars or arrays."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=_U32)
        x = x ^ (x >> _U32(16))
        x = x * _U32(0x7FEB352D)
        x = x ^ (x >> _U32(15))
        x = x * _U32(0x846CA68B)
        return x ^ (x >> _U32(16))


def blockquant_key(seed: int, step: int, stream: int) -> np.uint32:
    """BlockQuantKey: the counter's key of one (seed, step, stream)."""
    with np.errstate(over="ignore"):
        inner = blockquant_hash(blockquant_hash(_U32(seed % 2**32)) ^ _U32(step % 2**32))
        return blockquant_hash(inner + _U32(0x9E3779B9) * _U32(stream))


def blockquant_uniform(key, index: np.ndarray) -> np.ndarray:
    """BlockQuantUniform: u in [0, 1) of each element index (a multiple of 2^-24)."""
    with np.errstate(over="ignore"):
        h = blockquant_hash(blockquant_hash(index.astype(_U32) ^ key) + key)
    return (h >> _U32(8)).astype(np.float32) * np.float32(2.0**-24)


def blockquant_quantize(
    acc: np.ndarray, bits: int, block: int, stochastic: bool = False, key=0, first: int = 0
) -> np.ndarray:
    """Decoded BlockQuant encoding of acc (kernels/blockquant.h), float32 operation by
    operation: scale = absmax / qmax, inv = 1 / scale (both 0 when scale < FLT_MIN),
    q = rint(acc * inv) or trunc((acc * inv + u) + 256) - 256, clamped; decoded = q * scale."""
    qmax = np.float32(127 if bits == 8 else 7)
    out = np.zeros_like(acc, dtype=np.float32)
    for begin in range(0, acc.size, block):
        a = acc[begin : begin + block].astype(np.float32)
        scale = np.float32(np.max(np.abs(a))) / qmax
        with np.errstate(divide="ignore"):
            inv = np.float32(1.0) / scale
        if not scale >= np.finfo(np.float32).tiny:
            scale = inv = np.float32(0.0)
        t = a * inv
        if stochastic:
            index = np.arange(first + begin, first + begin + a.size)
            # floor(t + u) the kernels' way: trunc((t + u) + 256) - 256 in float32.
            shifted = (t + blockquant_uniform(key, index)) + np.float32(256.0)
            q = np.trunc(shifted) - np.float32(256.0)
        else:
            q = np.rint(t)
        q = np.clip(q, -qmax, qmax).astype(np.float32)
        out[begin : begin + block] = q * scale
    return out


def quantizer(c, step: int = 0) -> tuple:
    """(decode function acc -> decoded, slice unit) of a jaxcomm quantizer spec.

    The function also takes ``stream`` and ``first`` (the quantized allreduce's rank or sum
    stream, and the slice's first index), which only BlockQuant's stochastic rounding reads.
    """
    name = type(c).__name__
    if name == "BlockQuant":
        stochastic = c.rounding == "stochastic"

        def block_quantize(a, stream=0, first=0):
            key = blockquant_key(c.seed, step, stream)
            return blockquant_quantize(a, c.bits, c.block, stochastic, key, first)

        return block_quantize, c.block
    if name == "OneBit":
        assert c.sample_size == 0
        return (lambda a, stream=0, first=0: onebit_quantize(a, c.column_size)), c.column_size
    if name == "Threshold":
        return (lambda a, stream=0, first=0: threshold_quantize(a, c.tau, c.max_density)), 1
    assert name == "Adaptive" and c.sample_size == 0
    return (
        lambda a, stream=0, first=0: adaptive_quantize(a, c.proportion, c.column_size)
    ), c.column_size


def slice_range(n: int, parts: int, s: int, unit: int) -> tuple[int, int]:
    """kernels::SliceRange: unit-aligned slices, the first ones one unit longer."""
    units = -(-n // unit)

    def unit_begin(i: int) -> int:
        return i * (units // parts) + min(i, units % parts)

    return min(n, unit_begin(s) * unit), min(n, unit_begin(s + 1) * unit)


def quantized_allreduce(xs: list[np.ndarray], residuals: list[np.ndarray] | None, c, step: int = 0):
    """The whole quantized allreduce over P ranks (``step``: BlockQuant's stochastic rounding;
    rank q quantizes with stream q, the owners' sums with stream P).

    Returns (result, residuals_out, info): info["decoded"][q] is rank q's quantized acc
    (every slice decoded in place) and info["sums"][s] the owner's float sum of slice s before
    requantization, so callers can model the bytes each message carries.
    """
    quantize, unit = quantizer(c, step)
    parts = len(xs)
    n = xs[0].size
    accs = [x + r for x, r in zip(xs, residuals, strict=True)] if residuals else list(xs)
    accs = [a.astype(np.float32) for a in accs]
    decoded = [quantize_slices(a, parts, unit, quantize, q) for q, a in enumerate(accs)]
    res_out = [a - d for a, d in zip(accs, decoded, strict=True)]
    result = np.zeros(n, np.float32)
    sums = []
    for s in range(parts):
        b, e = slice_range(n, parts, s, unit)
        total = np.zeros(e - b, np.float32)
        for q in range(parts):
            total += decoded[q][b:e]
        sums.append(total)
        if e > b:
            requantized = quantize(total, parts, b)
            result[b:e] = requantized
            res_out[s][b:e] += total - requantized
    return result, res_out, {"decoded": decoded, "sums": sums}


def quantize_slices(
    acc: np.ndarray, parts: int, unit: int, quantize, stream: int = 0
) -> np.ndarray:
    """Each slice of acc quantized as a vector of its own, decoded back into place."""
    out = np.zeros_like(acc)
    for s in range(parts):
        b, e = slice_range(acc.size, parts, s, unit)
        if e > b:
            out[b:e] = quantize(acc[b:e], stream, b)
    return out


def even_range(n: int, parts: int, c: int) -> tuple[int, int]:
    def begin(i: int) -> int:
        return i * (n // parts) + min(i, n % parts)

    return begin(c), begin(c + 1)


def hierarchical_quantized(
    xs, residuals, c, nodes: int, local: int, scheme: str, owner_shift: int = 1, step: int = 0
):
    """Hierarchical quantized allreduce of ranks ordered (node, local) row-major: dense sum
    inside each node, quantized allreduce across nodes of the chunk (multi_leader: local rank
    l owns chunk (l + owner_shift) % L: 1 after a ring reduce-scatter, 0 after the CPU's
    shared-memory one) or of the whole vector (leader: local rank 0)."""
    n = xs[0].size
    accs = [(x + r).astype(np.float32) for x, r in zip(xs, residuals, strict=True)]
    node_sums = [
        np.sum(accs[j * local : (j + 1) * local], axis=0, dtype=np.float32) for j in range(nodes)
    ]
    result = np.zeros(n, np.float32)
    res_out = [np.zeros(n, np.float32) for _ in accs]
    if scheme == "leader":
        owners = [(0, 0, n)]
    else:
        owners = [(lr, *even_range(n, local, (lr + owner_shift) % local)) for lr in range(local)]
    for lr, b, e in owners:
        if e == b:
            continue
        part, part_res, _ = quantized_allreduce([s[b:e] for s in node_sums], None, c, step)
        result[b:e] = part
        for j in range(nodes):
            res_out[j * local + lr][b:e] = part_res[j]
    return result, res_out
