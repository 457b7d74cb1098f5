"""``overlap``: how much of the gradient allreduce hides behind the backward pass.

In every rank, a jitted data-parallel training step of an MLP (``layers`` square layers of
``width``, tanh, MSE loss; 25 x 1000 x 1000 + biases = 25.0M float32 gradient elements by
default) on a fixed per-device batch of ``batch`` rows, measured these ways, each median of
``repeats`` timed steps after one warm-up step, every timed step started together on all ranks
(a 1-element jaxcomm allreduce as barrier):

* ``compute``: the step without any communication (gradient, then SGD on the local gradient:
  the reducer replaced by the identity);
* ``comm``: ``jaxcomm.optax.allreduce_gradients(...).update`` alone, on fixed gradients
  (this rank's real gradient, computed once);
* ``step``: the real step, gradient -> ``allreduce_gradients`` -> SGD, for every bucket size
  in ``bucket_sizes`` (0 = one bucket holding the whole model: no overlap is possible);
* ``step_no_overlap``: the same step with ``allreduce_gradients(overlap=False)`` (every
  bucketed size, unless ``no_overlap_baseline`` is false), timed in turns with ``step``
  (one of each per round) so that both see the same machine;
* ``forward``: the loss alone (T_forward: what cannot overlap inside one step).

``comm`` and ``step`` are measured per algorithm (``dense``: ``algorithm=None``, the UCX
ring; ``gtopk``: ``jaxcomm.GTopK(density)``) and per bucket size, waiting for every step.
Then, at ``in_flight_bucket``, the real step runs ``repeats + 1`` steps through
``jaxcomm.paced(step, m)`` for every m in ``max_in_flight``: mean time per step, to show
whether step time depends on how far dispatch runs ahead. Finally one step of the same
configuration with ``jaxcomm.timeline.mark`` on every layer's weight gradient records a
timeline: when each gradient existed, and when the engine started and finished each bucket's
collective (``jaxcomm.metrics()["recent"]``), relative to the host's dispatch of that step.
A compute-only step is recorded the same way (and a ``start`` mark on the input says when
each device program began), and so is one ``comm`` call (collectives only).

Recipe ``args`` (declared in ``jobs/args.py``, ``OverlapArgs``): layers, width, batch (rows per
device), algorithms (``dense``, ``gtopk``), density, bucket_sizes (elements; 0 = single
bucket), first_bucket_size (elements of the first bucket of every bucketed step; default:
bucket size), max_in_flight, in_flight_bucket, no_overlap_baseline (default true), repeats
(>= 3), lr. Metrics lines: ``kind="time"`` (what, algorithm, bucket_size, max_in_flight,
step_time_s) and ``kind="timeline"`` (algorithm, bucket_size, timeline).
``benchmarks/overlap.py`` runs this job and computes the hidden fraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import AXIS, data_parallel_mesh, replicate, shard_batch
from jaxcomm_launcher.jobs.args import OverlapArgs

# The comparison this job draws (registry names) and its default buckets and pacing: its args
# are declared in jobs/args.py.
ALGORITHMS = tuple(OverlapArgs.model_fields["algorithms"].default_factory())
DEFAULT_BUCKET_SIZES = OverlapArgs.model_fields["bucket_sizes"].default_factory()
DEFAULT_MAX_IN_FLIGHT = OverlapArgs.model_fields["max_in_flight"].default_factory()


def _layer(i: int) -> str:
    return f"l{i:02d}"


def init_params(layers: int, width: int, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The MLP's parameters: ``layers`` square (width x width) layers with biases.

    Args:
        layers: Number of layers.
        width: Input, hidden and output width.
        seed: Seed of the (identical on every rank) initialization.

    Returns:
        ``{"l00": {"w": (width, width), "b": (width,)}, ...}`` in float32; tree order is layer
        order, so ``allreduce_gradients`` buckets the last layer first.

    Example:
        >>> sum(a.size for a in jax.tree.leaves(init_params(2, 4)))
        40
    """
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    return {
        _layer(i): {
            "w": (rng.standard_normal((width, width), dtype=np.float32) * scale),
            "b": np.zeros(width, np.float32),
        }
        for i in range(layers)
    }


def mlp_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of a tanh MLP (layers applied in tree order).

    Args:
        params: Output of :func:`init_params`.
        x: Inputs, ``(rows, width)``.
        y: Targets, ``(rows, width)``.

    Returns:
        The scalar loss.

    Example:
        >>> float(mlp_loss(init_params(1, 4), jnp.ones((2, 4)), jnp.zeros((2, 4)))) >= 0
        True
    """
    h = x
    for name in sorted(params):
        h = jnp.tanh(h @ params[name]["w"] + params[name]["b"])
    return jnp.mean((h - y) ** 2)


def _reducer(
    algorithm: str, density: float, bucket_size: int, first: int | None = None, overlap: bool = True
) -> Any:
    from jaxcomm import algorithms, cost
    from jaxcomm.optax import allreduce_gradients

    if algorithm not in ALGORITHMS:
        raise ValueError(f"args.algorithms: unknown {algorithm!r}; allowed: {list(ALGORITHMS)}")
    sizes = {"bucket_size": bucket_size, "first_bucket_size": first}
    # The spec from the registry (None: the dense allreduce).
    spec = algorithms.build(algorithm, cost.Options(density=density))
    return allreduce_gradients(AXIS, spec, overlap=overlap, **sizes)


def _sgd(params: Any, updates: Any, lr: float) -> Any:
    return jax.tree.map(lambda p, u: p - lr * u, params, updates)


def _mark_grads(grads: dict) -> dict:
    """Marks every layer's weight gradient (``grad/l00`` ...) where backward produced it."""
    import jaxcomm

    return {
        name: {**leaf, "w": jaxcomm.timeline.mark(leaf["w"], f"grad/{name}")}
        for name, leaf in grads.items()
    }


def _median_ms(times: list[float]) -> float:
    return float(np.median(times) * 1e3)


class _Bench:
    """The mesh, data and compiled functions shared by every measurement of one rank."""

    def __init__(self, ctx: JobContext) -> None:
        import jaxcomm

        a = self.args = OverlapArgs.model_validate(ctx.args)  # checked by the validator
        self.ctx = ctx
        self.layers, self.width, self.batch = a.layers, a.width, a.batch
        self.density, self.repeats, self.lr = a.density, a.repeats, a.lr
        self.mesh = data_parallel_mesh()
        self.host_params = init_params(self.layers, self.width)
        self.elements = sum(v.size for v in jax.tree.leaves(self.host_params))
        rng = np.random.default_rng(1 + ctx.rank)
        rows = ctx.devices_per_process * self.batch
        self.x = shard_batch(rng.standard_normal((rows, self.width), dtype=np.float32), self.mesh)
        self.y = shard_batch(rng.standard_normal((rows, self.width), dtype=np.float32), self.mesh)
        ones = shard_batch(np.ones((ctx.devices_per_process, 1), np.float32), self.mesh)
        barrier = jax.jit(
            jax.shard_map(
                lambda v: jaxcomm.allreduce(v[0], AXIS)[None],
                mesh=self.mesh,
                in_specs=P(AXIS),
                out_specs=P(AXIS),
            )
        )
        self._barrier = lambda: jax.block_until_ready(barrier(ones))
        self.step_index = 0

    def params(self) -> Any:
        """Fresh replicated parameters (steps donate theirs)."""
        return replicate(self.host_params, self.mesh)

    def shard_map(self, fn: Callable, in_specs: Any, out_specs: Any, donate: tuple = ()) -> Any:
        return jax.jit(
            jax.shard_map(
                fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            ),
            donate_argnums=donate,
        )

    def sync(self) -> None:
        """All ranks start the next timed step together; forgets metrics and marks."""
        import jaxcomm

        self._barrier()
        jaxcomm.reset_metrics()
        jaxcomm.timeline.reset_marks()

    def log_time(self, what: str, seconds: float, **fields: Any) -> None:
        self.ctx.metrics.log(
            self.step_index,
            force=True,
            kind="time",
            what=what,
            step_time_s=seconds,
            elements=self.elements,
            batch=self.batch,
            **fields,
        )
        self.step_index += 1

    def time_calls(self, call: Callable[[], Any], what: str, **fields: Any) -> list[float]:
        """One warm-up call, then `repeats` timed calls, each started on all ranks at once."""
        jax.block_until_ready(call())
        times = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.monotonic()
            jax.block_until_ready(call())
            times.append(time.monotonic() - t0)
            self.log_time(what, times[-1], **fields)
        return times

    def time_interleaved(
        self, calls: dict[str, Callable[[], Any]], **fields: Any
    ) -> dict[str, list[float]]:
        """`time_calls` for several calls at once, taking turns: one warm-up call each, then
        `repeats` rounds that time every call once, the first of each round rotating. Steps
        compared with each other (overlap=True against overlap=False) then share the
        machine's drift instead of each getting a block of time of its own."""
        for call in calls.values():
            jax.block_until_ready(call())
        names = list(calls)
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(self.repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                self.sync()
                t0 = time.monotonic()
                jax.block_until_ready(calls[name]())
                times[name].append(time.monotonic() - t0)
                self.log_time(name, times[name][-1], **fields)
        return times

    def timeline(self, call: Callable[[], Any], **fields: Any) -> None:
        """Runs `call` once (already compiled) and logs its marks and collectives."""
        import jaxcomm
        from jaxcomm import _world

        self.sync()
        t0 = time.monotonic()
        jax.block_until_ready(call())
        t1 = time.monotonic()
        device_ids = _world.world("cpu").device_ids
        rank_of_device = {d: r for r, d in enumerate(device_ids)}
        devices: dict[int, dict[str, list]] = {}
        for m in jaxcomm.timeline.marks():
            rank = rank_of_device.get(m["device_id"], m["device_id"])
            devices.setdefault(rank, {"marks": [], "collectives": []})["marks"].append(
                {"label": m["label"], "t": m["time"] - t0}
            )
        for r in jaxcomm.metrics()["recent"]:
            devices.setdefault(r["world_rank"], {"marks": [], "collectives": []})[
                "collectives"
            ].append(
                {
                    "seq": r["seq"],
                    "algorithm": r["algorithm"],
                    "elements": r["elements"],
                    "bytes_sent": r["bytes_sent"],
                    "queued": r["queued"] - t0,
                    "started": r["started"] - t0,
                    "finished": r["finished"] - t0,
                    "cpu_seconds": r["cpu_seconds"],
                }
            )
        self.ctx.metrics.log(
            self.step_index,
            force=True,
            kind="timeline",
            step_time_s=t1 - t0,
            timeline={str(k): v for k, v in sorted(devices.items())},
            **fields,
        )
        self.step_index += 1


def run(ctx: JobContext) -> None:
    """Measures T_compute, T_comm and T_step per algorithm, bucket size and pacing.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics lines (see the module docstring). Rank 0 prints medians.

    Example:
        >>> # python benchmarks/overlap.py   (generates a recipe with job: overlap)
    """
    import jaxcomm
    from jaxcomm.optax import DEFAULT_BUCKET_SIZE, partition_specs

    b = _Bench(ctx)
    a = b.args
    algorithms, bucket_sizes, in_flight = a.algorithms, a.bucket_sizes, a.max_in_flight
    in_flight_bucket = DEFAULT_BUCKET_SIZE if a.in_flight_bucket is None else a.in_flight_bucket
    serial = a.no_overlap_baseline  # also time overlap=False steps
    first = a.first_bucket_size  # None: every bucket of bucket_size
    if in_flight_bucket not in bucket_sizes:
        raise ValueError(
            f"args.in_flight_bucket ({in_flight_bucket}) must be one of args.bucket_sizes "
            f"{bucket_sizes}: the pacing sweep and the timeline reuse that step"
        )
    lr = b.lr
    say = ctx.print if ctx.is_main else (lambda *_: None)
    say(
        f"overlap: {b.layers} layers x {b.width}, {b.elements} gradient elements, "
        f"batch {b.batch} rows/device, {b.mesh.size} devices"
    )

    # T_compute: the reducer replaced by the identity (no communication at all).
    def compute_local(p: Any, x: jax.Array, y: jax.Array, marked: bool = False) -> Any:
        if marked:  # when the device program starts (its input exists at once)
            x = jaxcomm.timeline.mark(x, "start")
        g = jax.grad(mlp_loss)(p, x, y)
        return _sgd(p, _mark_grads(g) if marked else g, lr)

    specs_c = (P(), P(AXIS), P(AXIS))
    compute = b.shard_map(compute_local, specs_c, P(), donate=(0,))
    holder = {"p": b.params()}

    def call_compute(fn: Any = compute) -> Any:
        holder["p"] = fn(holder["p"], b.x, b.y)
        return holder["p"]

    times = b.time_calls(call_compute, "compute")
    say(f"  compute                 {_median_ms(times):9.1f} ms")
    # T_forward: the loss alone (what no overlap inside a step can hide: the first bucket
    # exists only after the forward pass and the last layer's backward).
    forward = b.shard_map(lambda p, x, y: mlp_loss(p, x, y)[None], specs_c, P(AXIS))
    fwd_params = b.params()
    times = b.time_calls(lambda: forward(fwd_params, b.x, b.y), "forward")
    say(f"  forward                 {_median_ms(times):9.1f} ms")
    marked = b.shard_map(
        lambda p, x, y: compute_local(p, x, y, marked=True), specs_c, P(), donate=(0,)
    )
    jax.block_until_ready(call_compute(marked))
    b.timeline(lambda: call_compute(marked), what="compute")

    # Fixed per-rank gradients for T_comm: this rank's real gradient, computed once.
    grad_fn = b.shard_map(
        lambda p, x, y: jax.tree.map(lambda g: g[None], jax.grad(mlp_loss)(p, x, y)),
        specs_c,
        P(AXIS),
    )
    grads = jax.block_until_ready(grad_fn(b.params(), b.x, b.y))

    for algorithm in algorithms:
        for bucket in bucket_sizes:
            size = bucket if bucket > 0 else b.elements  # 0: the whole model in one bucket
            tx = _reducer(algorithm, b.density, size, first if bucket > 0 else None)
            specs = partition_specs(jax.eval_shape(tx.init, b.host_params), AXIS)
            init = b.shard_map(tx.init, P(), specs)
            fields = {"algorithm": algorithm, "bucket_size": bucket}

            def comm_local(g: Any, s: Any, tx: Any = tx) -> Any:
                u, s = tx.update(jax.tree.map(lambda v: v[0], g), s)
                return jax.tree.map(lambda v: v[None], u), s

            comm = b.shard_map(comm_local, (P(AXIS), specs), (P(AXIS), specs), donate=(1,))
            state = {"s": init(b.params())}

            def call_comm(comm: Any = comm, state: dict = state) -> Any:
                u, state["s"] = comm(grads, state["s"])
                return u

            def step_local(
                p: Any, s: Any, x: jax.Array, y: jax.Array, marked: bool = False, tx: Any = tx
            ) -> Any:
                if marked:
                    x = jaxcomm.timeline.mark(x, "start")
                g = jax.grad(mlp_loss)(p, x, y)
                u, s = tx.update(_mark_grads(g) if marked else g, s)
                return _sgd(p, u, lr), s

            specs_s = (P(), specs, P(AXIS), P(AXIS))
            step = b.shard_map(step_local, specs_s, (P(), specs), donate=(0, 1))
            train = {"p": b.params()}
            train["s"] = init(train["p"])

            def call_step(fn: Any = step, train: dict = train) -> Any:
                train["p"], train["s"] = fn(train["p"], train["s"], b.x, b.y)
                return train["p"], train["s"]

            # Every time the hidden fraction combines is taken in the same rounds, so that
            # the machine's drift over a run (5-10 % on this host) does not enter it.
            steps = {
                "compute": call_compute,
                "forward": lambda: forward(fwd_params, b.x, b.y),
                "comm": call_comm,
                "step": call_step,
            }
            if bucket > 0 and serial:
                # The same step with overlap=False (each bucket awaited where it is issued):
                # overlap=True must never be slower. Timed in turns with the real step.
                tx_serial = _reducer(algorithm, b.density, size, first, overlap=False)
                serial_step = b.shard_map(
                    lambda p, s, x, y, t=tx_serial: step_local(p, s, x, y, tx=t),
                    specs_s,
                    (P(), specs),
                    donate=(0, 1),
                )
                steps["step_no_overlap"] = lambda f=serial_step: call_step(f)
            timed = b.time_interleaved(steps, max_in_flight=0, **fields)
            t_comm = timed["comm"]
            if bucket == in_flight_bucket:
                b.timeline(call_comm, what="comm", **fields)
            del state["s"]
            say(
                f"  {algorithm:6s} bucket {bucket:>9d}: comm {_median_ms(t_comm):9.1f} ms, "
                f"step {_median_ms(timed['step']):9.1f} ms"
            )
            if "step_no_overlap" in timed:
                say(
                    f"  {algorithm:6s} bucket {bucket:>9d}: overlap=False "
                    f"{_median_ms(timed['step_no_overlap']):9.1f} ms"
                )
            if bucket != in_flight_bucket:
                train.clear()  # 4 ranks share this machine's memory: free before the next
                continue
            # Step time against how far dispatch runs ahead (jaxcomm.paced).
            for m in in_flight:
                paced = jaxcomm.paced(step, m)
                n = b.repeats + 1
                b.sync()
                t0 = time.monotonic()
                for _ in range(n):
                    train["p"], train["s"] = paced(train["p"], train["s"], b.x, b.y)
                paced.wait()
                per_step = (time.monotonic() - t0) / n
                b.log_time("paced", per_step, max_in_flight=m, **fields)
                say(f"  {algorithm:6s} paced max_in_flight={m}: {per_step * 1e3:9.1f} ms/step")
            marked_step = b.shard_map(
                lambda p, s, x, y, f=step_local: f(p, s, x, y, marked=True),
                specs_s,
                (P(), specs),
                donate=(0, 1),
            )
            jax.block_until_ready(call_step(marked_step))
            b.timeline(lambda f=marked_step: call_step(f), what="step", **fields)
            train.clear()
