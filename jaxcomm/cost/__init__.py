"""A cost model of every jaxcomm allreduce: bytes on the wire and seconds per call.

Compression pays only when the network, not local compute, is the bottleneck. This module
predicts, for each algorithm, the bytes one rank sends and the time one call takes, so a user
(``jaxcomm plan``) or the optimizer (``algorithm="auto"``) can pick an algorithm before
spending compute on it.

Model
-----
A call's time is a sum of terms on its critical path:

* ``alpha[c]`` seconds per message and ``beta[c]`` seconds per byte, for the link class ``c``
  a message travels: ``same_process`` (two devices of one process), ``same_host`` (two
  processes of one machine: UCX shared memory or loopback) or ``across_hosts`` (a network).
  When several ranks of one process send across the process boundary at once, they share it:
  their bytes are multiplied by the number of such concurrent flows (``contention``).
* ``gamma[kernel]`` seconds per element of each local kernel: ``topk`` (top-k selection with
  error feedback over n elements), ``quantize.<kind>`` and ``decode.<kind>`` (one-bit,
  threshold, adaptive), ``merge`` (gTop-k's sparse ⊤ merge, per input entry) and ``sum``
  (one elementwise pass over float32 memory: a reduction, a copy, a memset or a scatter).

Byte counts are exact: they follow the schedules of ``ffi/*.cc`` message by message (the
ring's chunks, gTop-k's tree, the quantized allreduce's slices and ``used`` words) and equal
what ``jaxcomm.metrics()`` reports for the same call. Two algorithms send data-dependent
amounts, described by :class:`Options`: threshold (the fraction of entries above ``tau``) and
adaptive (the sign balance and how much the ranks' selections overlap).

A :class:`Profile` holds alpha, beta and gamma. ``jaxcomm probe RECIPE --out profile.json``
measures one on the recipe's own world; :data:`DEFAULT_PROFILE` is a measured fallback.

Layout
------
* :mod:`jaxcomm.cost.model`: the data (``World``, ``Options``, ``Link``, ``Profile`` and its
  JSON, ``Prediction``); ``Options``' fields are the settings the algorithms' modules declare
  (:func:`jaxcomm.algorithms.settings`) plus the gradient's ``element_bytes``;
* :mod:`jaxcomm.cost.algorithm_costs`: what the model knows of each algorithm of
  :mod:`jaxcomm.algorithms`, one ``AlgorithmCost`` per name (its schedule's bytes and time,
  its kernels, its place among ``auto``'s candidates);
* :mod:`jaxcomm.cost.ledger`: the byte ledger, summing each algorithm's schedule per world;
* :mod:`jaxcomm.cost.timemodel`: the time model and its least-squares line;
* :mod:`jaxcomm.cost.choose`: predictions for every candidate and the fastest one;
* :mod:`jaxcomm.cost.auto`: ``algorithm="auto"`` at trace time and its decision log;
* :mod:`jaxcomm.cost.schedule`: auto under a density schedule (each phase's ``Auto``, and
  whether the warm-up is followed);
* :mod:`jaxcomm.cost.measure`: ``auto`` without a profile measures the run's own world
  (:func:`measure_world`; it needs JAX when called);
* :mod:`jaxcomm.cost.probe`: ``jaxcomm probe``'s thorough measurement (:func:`probe_world`:
  more sizes, ``lax.psum``, every kernel, :mod:`jaxcomm.cost.kernels`), on the same
  collectives (:mod:`jaxcomm.cost.timing`) and fits (:mod:`jaxcomm.cost.fit`);
* :mod:`jaxcomm.cost.learn`: the steps each compressor costs, learned from the run: which
  arm runs when (:mod:`jaxcomm.cost.arms`: which arms are tried, which goes first) and what the
  trial windows show (:mod:`jaxcomm.cost.windows`).

The package imports neither JAX nor the compiled library (``jaxcomm plan`` imports it in the
launcher's own process, which never loads JAX); it reads
``JAXCOMM_SMALL_ALLREDUCE_BYTES`` through :mod:`jaxcomm.config`, as the library does.

Example:
  >>> from jaxcomm import cost
  >>> world = cost.World(processes=4, devices_per_process=1, inter_process="across_hosts")
  >>> p = cost.predict("gtopk", 25_000_000, world, options=cost.Options(density=0.001))
  >>> p.bytes_sent_per_rank  # 2(P-1) sets of 2k words over P ranks
  300000.0
"""

from __future__ import annotations

from .auto import (
    Auto,
    auto_algorithm,
    auto_decisions,
    resolve_auto,
    warmup_pays,
)
from .choose import choose, plan
from .ledger import (
    bytes_sent,
    dense_bytes,
    direct_bytes,
    doubling_bytes,
    gtopk_sends,
    oneshot_bytes,
    quantized_bytes,
    ring_bytes,
    small_allreduce_bytes,
)
from .measure import measure_world
from .model import (
    ALGORITHMS,
    AUTO_CHOICES,
    COMMON_SETTINGS,
    DEFAULT_ALLOWED,
    DEFAULT_PROFILE,
    DEFAULT_STEPS_FACTOR,
    KERNELS,
    LINK_CLASSES,
    QUANTIZER_KINDS,
    SETTINGS,
    Link,
    Options,
    Prediction,
    Profile,
    World,
    steps_factor_of,
)
from .probe import probe_world
from .schedule import at_density, follow_schedule
from .timemodel import Tally, dense_path, fit_line, predict, predict_tree, ring_path

__all__ = [
    "ALGORITHMS",
    "AUTO_CHOICES",
    "COMMON_SETTINGS",
    "DEFAULT_ALLOWED",
    "DEFAULT_PROFILE",
    "DEFAULT_STEPS_FACTOR",
    "KERNELS",
    "LINK_CLASSES",
    "QUANTIZER_KINDS",
    "SETTINGS",
    "Auto",
    "Link",
    "Options",
    "Prediction",
    "Profile",
    "Tally",
    "World",
    "at_density",
    "auto_algorithm",
    "auto_decisions",
    "warmup_pays",
    "bytes_sent",
    "choose",
    "dense_bytes",
    "dense_path",
    "direct_bytes",
    "doubling_bytes",
    "fit_line",
    "follow_schedule",
    "measure_world",
    "probe_world",
    "gtopk_sends",
    "oneshot_bytes",
    "plan",
    "predict",
    "predict_tree",
    "quantized_bytes",
    "resolve_auto",
    "ring_bytes",
    "ring_path",
    "small_allreduce_bytes",
    "steps_factor_of",
]
