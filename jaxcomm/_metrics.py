"""Per-collective metrics recorded by the C++ handlers: bytes on the wire, time, algorithm.

Reading them costs a JSON copy on the host and never synchronizes a device: the handlers
append a record when each collective finishes.
"""

from __future__ import annotations

from typing import Any

from jaxcomm import _ffi


def metrics() -> dict[str, Any]:
    """Returns the metrics of every jaxcomm collective this process ran.

    Returns:
      ``{"totals": [...], "recent": [...]}``. Each total aggregates one (world rank, API name,
      algorithm); the algorithm labels are those of ``jaxcomm.cost`` (``dense``,
      ``topk_allgather``, ``gtopk``, ``onebit``, ``threshold``, ``adaptive``; ``dense`` is the
      ring over a transport, and the dense schedules of ffi/allreduce.h add
      ``dense_doubling`` (small vectors over a transport), ``dense_direct`` and
      ``dense_direct_oneshot`` (through shared memory when every rank of the group is on this
      host, large and small)), ``dense_bf16`` / ``dense_f16`` (the 16-bit wire) and
      ``dense_bf16_direct`` / ``dense_f16_direct`` (the same sums through shared memory;
      bytes as ``jaxcomm.cost.direct_bytes``),
      ``hierarchical_<dense|onebit|threshold|adaptive>`` (``_leader`` for the single-leader
      scheme): ``calls``, ``group_size``, ``elements``, ``bytes_sent``, ``bytes_received``,
      ``seconds``, ``dense_bytes_sent`` (what a dense float32 schedule would have sent; equal
      to ``bytes_sent`` for dense collectives) and ``compression_ratio``
      (``dense_bytes_sent / bytes_sent``, 1.0 when nothing was sent). ``recent`` lists the
      last 4096 calls individually (with ``seq``; ``queued``: when XLA ran the call's handler,
      which queued it on the engine; ``started``/``finished``: when the engine started and
      finished it; all in seconds of ``time.monotonic()``'s clock). ``auto``: what
      ``algorithm="auto"`` measured and decided in this process (:func:`auto_report`).

    Example:
      >>> import jaxcomm
      >>> totals = jaxcomm.metrics()["totals"]
    """
    result = _ffi.read_json("jaxcomm_metrics_json")
    for record in result["totals"] + result["recent"]:
        sent = record["bytes_sent"]
        record["compression_ratio"] = record["dense_bytes_sent"] / sent if sent else 1.0
    result["auto"] = auto_report()
    return result


def auto_report() -> dict[str, Any]:
    """What ``algorithm="auto"`` measured and decided in this process.

    Returns:
      ``{"measured", "decisions", "learned"}``: the world's measurement
      (:func:`jaxcomm.cost.measure.measured`: the profile, its seconds; None when auto had a
      profile), each bucket's choice with the link numbers it read
      (:func:`jaxcomm.cost.auto_decisions`), and the learner's windows and decisions
      (:func:`jaxcomm.cost.learn.decisions`).

    Example:
      >>> sorted(auto_report())
      ['decisions', 'learned', 'measured']
    """
    from jaxcomm.cost import auto_decisions, learn, measure

    return {
        "measured": measure.measured(),
        "decisions": auto_decisions(),
        "learned": learn.decisions(),
    }


def reset_metrics() -> None:
    """Forgets all recorded metrics (e.g. after warm-up steps).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.reset_metrics()
    """
    _ffi.library().jaxcomm_metrics_reset()
