"""The overlap benchmark's job: how much of the gradient allreduce hides behind the backward pass.

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

Recipe ``args`` (:class:`OverlapArgs`, checked when the job starts): layers, width, batch
(rows per device), algorithms (``dense``, ``gtopk``), density, bucket_sizes (elements; 0 =
single bucket), first_bucket_size (elements of the first bucket of every bucketed step;
default: bucket size), max_in_flight, in_flight_bucket, no_overlap_baseline (default true),
repeats (>= 3), lr. Metrics lines: ``kind="time"`` (what, algorithm, bucket_size,
max_in_flight, step_time_s) and ``kind="timeline"`` (algorithm, bucket_size, timeline).

``benchmarks/overlap.py`` runs this job (a recipe with ``job: overlap_job:run`` and this folder
on its ``pythonpath``) and computes the hidden fraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import AXIS, data_parallel_mesh, replicate, shard_batch
from jaxcomm_launcher.jobs.args import JobArgs
from pydantic import Field


class OverlapArgs(JobArgs):
    """The job's recipe ``args``: the MLP, the reductions compared, their buckets and pacing."""

    layers: int = Field(25, ge=1, description="MLP layers")
    width: int = Field(1000, ge=1, description="width of every layer")
    batch: int = Field(128, ge=1, description="rows per device")
    algorithms: list[Literal["dense", "gtopk"]] = Field(
        default_factory=lambda: ["dense", "gtopk"], description="the reductions compared"
    )
    density: float = Field(0.001, gt=0.0, le=1.0, description="gtopk's density")
    bucket_sizes: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [1 << 20, 1 << 22, 1 << 24, 0],
        min_length=1,
        description="elements per bucket (0: one bucket)",
    )
    first_bucket_size: int | None = Field(
        None, ge=1, description="elements of the first bucket (None: the bucket size)"
    )
    max_in_flight: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0, 1, 2, 4], description="paced steps in flight, each timed"
    )
    in_flight_bucket: int | None = Field(
        None, ge=0, description="bucket size of the pacing sweep (None: the library's default)"
    )
    no_overlap_baseline: bool = Field(True, description="also time overlap=False steps")
    repeats: int = Field(5, ge=3, description="timed rounds (medians)")
    lr: float = Field(1e-4, gt=0.0, description="SGD learning rate")


# The comparison this job draws (registry names) and its default buckets and pacing.
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


def reducer(
    algorithm: str, density: float, bucket_size: int, first: int | None = None, overlap: bool = True
) -> Any:
    """``allreduce_gradients`` of registry name `algorithm` (``dense``: the UCX ring) with
    these bucket sizes (`first`: the first bucket's; None: ``bucket_size``)."""
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

        # A module:function job: the launcher does not know these args, the model checks them.
        a = self.args = OverlapArgs.model_validate(ctx.args)
        self.ctx = ctx
        self.say = ctx.print if ctx.is_main else (lambda *_: None)
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


SPECS_COMPUTE = (P(), P(AXIS), P(AXIS))
"""In-specs of a step's (params, x, y): parameters replicated, the batch split over ranks."""


class _Compute:
    """The step without communication, the loss alone, and this rank's fixed gradient: what
    every algorithm's and bucket's rounds time again beside their own steps."""

    def __init__(self, b: _Bench) -> None:
        self.b = b
        self.holder = {"p": b.params()}
        self.step = b.shard_map(self.local, SPECS_COMPUTE, P(), donate=(0,))
        self.loss = b.shard_map(lambda p, x, y: mlp_loss(p, x, y)[None], SPECS_COMPUTE, P(AXIS))
        self.loss_params = b.params()
        self.grads: Any = None

    def local(self, p: Any, x: jax.Array, y: jax.Array, marked: bool = False) -> Any:
        """T_compute's step: the reducer replaced by the identity (no communication at all)."""
        import jaxcomm

        if marked:  # when the device program starts (its input exists at once)
            x = jaxcomm.timeline.mark(x, "start")
        g = jax.grad(mlp_loss)(p, x, y)
        return _sgd(p, _mark_grads(g) if marked else g, self.b.lr)

    def call(self, fn: Any = None) -> Any:
        self.holder["p"] = (fn or self.step)(self.holder["p"], self.b.x, self.b.y)
        return self.holder["p"]

    def forward(self) -> Any:
        return self.loss(self.loss_params, self.b.x, self.b.y)


def _measure_compute(b: _Bench) -> _Compute:
    """Times T_compute and T_forward, records the compute step's timeline, and computes the
    fixed per-rank gradients that T_comm reduces."""
    c = _Compute(b)
    times = b.time_calls(c.call, "compute")
    b.say(f"  compute                 {_median_ms(times):9.1f} ms")
    # T_forward: the loss alone (what no overlap inside a step can hide: the first bucket
    # exists only after the forward pass and the last layer's backward).
    times = b.time_calls(c.forward, "forward")
    b.say(f"  forward                 {_median_ms(times):9.1f} ms")
    marked = b.shard_map(
        lambda p, x, y: c.local(p, x, y, marked=True), SPECS_COMPUTE, P(), donate=(0,)
    )
    jax.block_until_ready(c.call(marked))
    b.timeline(lambda: c.call(marked), what="compute")
    # Fixed per-rank gradients for T_comm: this rank's real gradient, computed once.
    grad_fn = b.shard_map(
        lambda p, x, y: jax.tree.map(lambda g: g[None], jax.grad(mlp_loss)(p, x, y)),
        SPECS_COMPUTE,
        P(AXIS),
    )
    c.grads = jax.block_until_ready(grad_fn(b.params(), b.x, b.y))
    return c


class _Bucketed:
    """One algorithm at one bucket size: its ``comm`` call on fixed gradients and its
    training step, each with the state it carries from call to call."""

    def __init__(self, b: _Bench, algorithm: str, bucket: int, grads: Any) -> None:
        from jaxcomm.optax import partition_specs

        self.b, self.algorithm, self.bucket, self.grads = b, algorithm, bucket, grads
        self.size = bucket if bucket > 0 else b.elements  # 0: the whole model in one bucket
        self.fields = {"algorithm": algorithm, "bucket_size": bucket}
        first = b.args.first_bucket_size if bucket > 0 else None
        self.tx = reducer(algorithm, b.density, self.size, first)
        self.specs = partition_specs(jax.eval_shape(self.tx.init, b.host_params), AXIS)
        init = b.shard_map(self.tx.init, P(), self.specs)
        self.comm = b.shard_map(
            self.comm_local, (P(AXIS), self.specs), (P(AXIS), self.specs), donate=(1,)
        )
        self.state = {"s": init(b.params())}
        self.step = self.compile_step()
        self.train = {"p": b.params()}
        self.train["s"] = init(self.train["p"])

    def comm_local(self, g: Any, s: Any) -> Any:
        u, s = self.tx.update(jax.tree.map(lambda v: v[0], g), s)
        return jax.tree.map(lambda v: v[None], u), s

    def step_local(self, p: Any, s: Any, x: jax.Array, y: jax.Array, marked: bool, tx: Any) -> Any:
        import jaxcomm

        if marked:
            x = jaxcomm.timeline.mark(x, "start")
        g = jax.grad(mlp_loss)(p, x, y)
        u, s = tx.update(_mark_grads(g) if marked else g, s)
        return _sgd(p, u, self.b.lr), s

    def compile_step(self, tx: Any = None, marked: bool = False) -> Any:
        """The jitted step through `tx` (None: this bucket's reducer); `marked`: with marks."""
        tx = self.tx if tx is None else tx
        return self.b.shard_map(
            lambda p, s, x, y: self.step_local(p, s, x, y, marked, tx),
            (P(), self.specs, P(AXIS), P(AXIS)),
            (P(), self.specs),
            donate=(0, 1),
        )

    def call_comm(self) -> Any:
        u, self.state["s"] = self.comm(self.grads, self.state["s"])
        return u

    def call_step(self, fn: Any = None) -> Any:
        train = self.train
        train["p"], train["s"] = (fn or self.step)(train["p"], train["s"], self.b.x, self.b.y)
        return train["p"], train["s"]


def _time_rounds(b: _Bench, c: _Compute, k: _Bucketed) -> dict[str, list[float]]:
    """Times compute, forward, comm, the step and (bucketed) the overlap=False step in turns."""
    # Every time the hidden fraction combines is taken in the same rounds, so that the
    # machine's drift over a run does not enter it.
    steps = {"compute": c.call, "forward": c.forward, "comm": k.call_comm, "step": k.call_step}
    if k.bucket > 0 and b.args.no_overlap_baseline:
        # The same step with overlap=False (each bucket awaited where it is issued):
        # overlap=True must never be slower. Timed in turns with the real step.
        first = b.args.first_bucket_size
        serial_tx = reducer(k.algorithm, b.density, k.size, first, overlap=False)
        serial_step = k.compile_step(serial_tx)
        steps["step_no_overlap"] = lambda: k.call_step(serial_step)
    timed = b.time_interleaved(steps, max_in_flight=0, **k.fields)
    label = f"  {k.algorithm:6s} bucket {k.bucket:>9d}:"
    b.say(
        f"{label} comm {_median_ms(timed['comm']):9.1f} ms, "
        f"step {_median_ms(timed['step']):9.1f} ms"
    )
    if "step_no_overlap" in timed:
        b.say(f"{label} overlap=False {_median_ms(timed['step_no_overlap']):9.1f} ms")
    return timed


def _time_paced(b: _Bench, k: _Bucketed) -> None:
    """Step time against how far dispatch runs ahead (``jaxcomm.paced``)."""
    import jaxcomm

    for m in b.args.max_in_flight:
        paced = jaxcomm.paced(k.step, m)
        n = b.repeats + 1
        b.sync()
        t0 = time.monotonic()
        for _ in range(n):
            k.train["p"], k.train["s"] = paced(k.train["p"], k.train["s"], b.x, b.y)
        paced.wait()
        per_step = (time.monotonic() - t0) / n
        b.log_time("paced", per_step, max_in_flight=m, **k.fields)
        b.say(f"  {k.algorithm:6s} paced max_in_flight={m}: {per_step * 1e3:9.1f} ms/step")


def _measure_bucket(
    b: _Bench, c: _Compute, algorithm: str, bucket: int, in_flight_bucket: int
) -> None:
    """Times one algorithm at one bucket size; at `in_flight_bucket` also its pacing and the
    timelines of its comm call and of its step."""
    k = _Bucketed(b, algorithm, bucket, c.grads)
    _time_rounds(b, c, k)
    if bucket == in_flight_bucket:
        b.timeline(k.call_comm, what="comm", **k.fields)
    del k.state["s"]
    if bucket == in_flight_bucket:
        _time_paced(b, k)
        marked_step = k.compile_step(marked=True)
        jax.block_until_ready(k.call_step(marked_step))
        b.timeline(lambda: k.call_step(marked_step), what="step", **k.fields)
    k.train.clear()  # 4 ranks share this machine's memory: free before the next


def run(ctx: JobContext) -> None:
    """Measures T_compute, T_comm and T_step per algorithm, bucket size and pacing.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics lines (see the module docstring). Rank 0 prints medians.

    Example:
        >>> # python benchmarks/overlap.py   (generates a recipe with job: overlap_job:run)
    """
    from jaxcomm.optax import DEFAULT_BUCKET_SIZE

    b = _Bench(ctx)
    a = b.args
    in_flight_bucket = DEFAULT_BUCKET_SIZE if a.in_flight_bucket is None else a.in_flight_bucket
    if in_flight_bucket not in a.bucket_sizes:
        raise ValueError(
            f"args.in_flight_bucket ({in_flight_bucket}) must be one of args.bucket_sizes "
            f"{a.bucket_sizes}: the pacing sweep and the timeline reuse that step"
        )
    b.say(
        f"overlap: {b.layers} layers x {b.width}, {b.elements} gradient elements, "
        f"batch {b.batch} rows/device, {b.mesh.size} devices"
    )
    c = _measure_compute(b)
    for algorithm in a.algorithms:
        for bucket in a.bucket_sizes:
            _measure_bucket(b, c, algorithm, bucket, in_flight_bucket)
