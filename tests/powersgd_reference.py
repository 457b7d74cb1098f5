"""A NumPy reference of PyTorch DDP's ``powerSGD_hook`` over all ranks at once.

Written from the hook's documented steps (torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py; ``use_error_feedback``, ``warm_start`` and ``orthogonalization_epsilon`` as
the arguments of :class:`Hook` say), for one bucket that holds every leaf:

- while ``step < start_step``: the vanilla allreduce (the sum divided by the world size), no
  error kept;
- then per rank: M = g + e for the whole bucket (e zero the first time); each leaf of two or
  more dimensions viewed as ``(-1, shape[-1])`` (jaxcomm's default ``layout="jax"``: the
  hook's ``(shape[0], -1)`` of PyTorch's layout) is compressed when ``_should_compress`` says
  so (``rows * cols > min_rate * (rows + cols) * r``, r = min(rows, cols, rank)); the others
  are summed and divided by the world size; Q orthogonalized (Gram-Schmidt), P = M Q, P summed
  over ranks and orthogonalized, Q = Mᵀ P summed over ranks and divided by the world size
  (kept for the next step), the leaf becomes P Qᵀ; e = M_before - M_after for the whole
  bucket (``hook_dense_error=True``: the hook also keeps ``M - mean(M)`` for the leaves sent
  dense; jaxcomm keeps no error for them, ``hook_dense_error=False``).

The first Q of each leaf is an input (the hook draws it from torch's generator; jaxcomm from
JAX's), so the reference starts from jaxcomm's initial state; without warm start, so are the
Qs drawn at each step.
"""

from __future__ import annotations

import numpy as np


def orthogonalize(m: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """The hook's Gram-Schmidt, column by column: divided by the norm plus ``epsilon`` (with
    ``epsilon`` 0, a zero column stays zero)."""
    m = m.astype(np.float32).copy()
    for i in range(m.shape[1]):
        norm = np.float32(np.sqrt(np.sum(m[:, i] * m[:, i])))
        if epsilon:
            m[:, i] = m[:, i] / (norm + np.float32(epsilon))
        else:
            m[:, i] = m[:, i] / norm if norm > 0 else 0.0
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= np.sum(m[:, i] * m[:, j]) * m[:, i]
    return m


def plan(shape: tuple[int, ...], rank: int, min_rate: float):
    if len(shape) < 2:
        return None
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    r = min(rows, cols, rank)
    return (rows, cols, r) if rows * cols > min_rate * (rows + cols) * r else None


class Hook:
    """The hook's state for ``world`` ranks and leaves of ``shapes``.

    Args:
      shapes: leaf shapes, in tree order.
      world: number of ranks.
      rank, start_step, min_rate: the PowerSGD settings.
      initial_qs: ``{leaf index: (cols, r) float32}`` of the compressed leaves.
      hook_dense_error: keep the hook's error of the leaves sent dense.
      out_dtype: the gradients' dtype (outputs are rounded to it, as the hook writes them
        into the bucket).
      error_feedback: the hook's ``use_error_feedback``.
      epsilon: the hook's ``orthogonalization_epsilon``.
      fresh_qs: without warm start (the hook's ``warm_start=False``), ``step -> {leaf index:
        Q}`` drawn at each compressed step; None: warm start.
    """

    def __init__(
        self,
        shapes,
        world,
        rank,
        start_step,
        min_rate,
        initial_qs,
        hook_dense_error=True,
        out_dtype=np.float32,
        error_feedback=True,
        epsilon=0.0,
        fresh_qs=None,
    ):
        self.shapes = [tuple(s) for s in shapes]
        self.world = world
        self.start_step = start_step
        self.plans = [plan(s, rank, min_rate) for s in self.shapes]
        self.qs = {i: np.asarray(q, np.float32) for i, q in initial_qs.items()}
        self.errors = [[np.zeros(s, np.float32) for s in self.shapes] for _ in range(world)]
        self.hook_dense_error = hook_dense_error
        self.out_dtype = out_dtype
        self.error_feedback = error_feedback
        self.epsilon = epsilon
        self.fresh_qs = fresh_qs
        self.step = 0

    def __call__(self, grads):
        """One step. ``grads[rank][leaf]``: every rank's gradients; returns the average of
        each leaf (the same on every rank)."""
        w = self.world
        if self.step < self.start_step:
            self.step += 1
            return [
                (sum(grads[r][i].astype(np.float32) for r in range(w)) / w).astype(self.out_dtype)
                for i in range(len(self.shapes))
            ]
        if not self.error_feedback:  # the hook adds no error and keeps none
            self.errors = [[np.float32(0.0) for _ in self.shapes] for _ in range(w)]
        ms = [
            [grads[r][i].astype(np.float32) + self.errors[r][i] for i in range(len(self.shapes))]
            for r in range(w)
        ]
        out = [None] * len(self.shapes)
        for i, p in enumerate(self.plans):
            if p is None:
                out[i] = (sum(ms[r][i] for r in range(w)) / w).astype(self.out_dtype)
        comp = [i for i, p in enumerate(self.plans) if p is not None]
        mats = {(r, i): ms[r][i].reshape(self.plans[i][:2]) for r in range(w) for i in comp}
        starts = self.qs if self.fresh_qs is None else self.fresh_qs(self.step)
        qs = {i: orthogonalize(starts[i], self.epsilon) for i in comp}
        ps = {
            i: orthogonalize(sum(mats[r, i] @ qs[i] for r in range(w)), self.epsilon) for i in comp
        }
        for i in comp:
            q = sum(mats[r, i].T @ ps[i] for r in range(w)) / np.float32(w)
            self.qs[i] = q.astype(np.float32)
            out[i] = (ps[i] @ q.T).reshape(self.shapes[i]).astype(self.out_dtype)
        for r in range(w):
            for i in range(len(self.shapes)):
                if self.plans[i] is None and not self.hook_dense_error:
                    continue
                if self.error_feedback:
                    self.errors[r][i] = ms[r][i] - out[i].astype(np.float32)
        self.step += 1
        return out
