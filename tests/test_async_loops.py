"""Training loops the way users run them: no synchronization per step (tests/async_loop_worker.py).

- Paced loops (jaxcomm.paced) on 1x2, 1x4, 1x8, 2x2 and 4x1 (processes x devices), for dense and
  every compressor, 300 steps, end with parameters equal bit for bit to a loop that waits for
  every step, on every rank.
- A raw loop (no helper) on 1x4 finishes, or raises one short error within the timeout.
- A peer killed while steps are queued makes every other rank raise one short error naming it.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from collectives_harness import run_world

WORKER = pathlib.Path(__file__).with_name("async_loop_worker.py")
REDUCERS = ["dense", "topk_allgather", "gtopk", "onebit", "threshold", "adaptive"]
CHAIN = "Error dispatching computation"


def run(processes, devices, tmp_path, mode, timeout, **env):
    return run_world(
        processes, devices, tmp_path, mode=mode, timeout=timeout, env=env, worker=WORKER
    )


def outputs(run_) -> str:
    return "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(run_.outputs))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("processes,devices", [(1, 2), (1, 4), (1, 8), (2, 2), (4, 1)])
def test_paced_loop_equals_synchronized_loop(tmp_path, processes, devices):
    result = run(processes, devices, tmp_path, "paced", 360, JAXCOMM_TIMEOUT_S="60")
    assert result.returncodes == [0] * processes, outputs(result)
    for name in REDUCERS:
        for leaf in ("w1", "w2"):
            key = f"{name}/{leaf}"
            paced = result.results[f"paced/{key}"]
            synced = result.results[f"synced/{key}"]
            assert np.all(np.isfinite(paced)), key
            np.testing.assert_array_equal(paced, synced, err_msg=key)
    # Every process ends with the same parameters (replicated, bit-identical sums).
    for pid in range(1, processes):
        with np.load(tmp_path / f"process{pid}.npz") as other:
            for key in other.files:
                np.testing.assert_array_equal(other[key], result.results[key], err_msg=key)


@pytest.mark.timeout(200)
def test_raw_unsynchronized_loop_finishes_or_fails_once(tmp_path):
    result = run(1, 4, tmp_path, "raw", 150, JAXCOMM_TIMEOUT_S="20", JAXCOMM_TEST_STEPS="600")
    report_path = tmp_path / "raw0.json"
    assert report_path.exists(), "the raw loop hung silently\n" + outputs(result)
    report = json.loads(report_path.read_text())
    assert result.returncodes == [0], outputs(result)
    if not report["finished"]:
        error = report["error"]
        assert CHAIN not in error, error[:2000]
        assert error.count("jaxcomm.") == 1 and len(error) < 1000, error[:2000]
        assert "never started" in error, error
    # Nothing is printed again at exit (JAX's runtime tokens of the failed steps).
    assert CHAIN not in result.outputs[0], result.outputs[0][-3000:]


@pytest.mark.timeout(200)
def test_killed_peer_while_steps_are_queued(tmp_path):
    result = run(3, 1, tmp_path, "killed", 150, JAXCOMM_TIMEOUT_S="20", JAXCOMM_TEST_STEPS="400")
    assert result.returncodes[1] != 0  # it killed itself
    for pid in (0, 2):
        assert result.returncodes[pid] == 0, outputs(result)
        report = json.loads((tmp_path / f"killed{pid}.json").read_text())
        error = report["error"]
        assert error is not None, f"process {pid} did not notice the dead peer"
        assert CHAIN not in error and len(error) < 1000, error[:2000]
        assert "rank 1" in error, error
        # The loop stopped at the death, not at the end (an order of events, not a clock):
        # no step from DIE_AT on can complete, so a paced loop dispatches at most
        # max_in_flight more before the call that raises.
        assert report["dispatched"] <= report["die_at"] + report["max_in_flight"], report


@pytest.mark.timeout(200)
def test_first_bucket_starts_before_backward_ends(tmp_path):
    """The last layer's bucket starts before backward produced the first layer's gradient.

    This shows the collectives are issued in backward order and that the handler does not wait
    for the whole backward (1 process x 2 devices).
    """
    result = run(1, 2, tmp_path, "overlap", 150, JAXCOMM_TIMEOUT_S="60")
    assert result.returncodes == [0], outputs(result)
    steps = json.loads((tmp_path / "overlap0.json").read_text())
    for step in steps:
        assert len(step) == 2, step
        for device, times in step.items():
            assert times["first_collective_started"] < times["grad_l0"], (device, steps)


@pytest.mark.timeout(200)
def test_backward_runs_while_first_bucket_is_on_the_wire(tmp_path):
    """Compute and communication run at the same time (2 processes x 1 device).

    Process 1 calls every step a second late (async_loop_worker.LATE_S), so process 0's first
    bucket cannot finish before process 1 joins it. Process 0's backward must nonetheless
    produce the first layer's gradient before that bucket finishes: backward ran while the
    collective was on the wire. Awaiting each bucket where it is issued fails this, because
    XLA:CPU makes the ops that reuse the collective's buffers wait for it.
    """
    result = run(2, 1, tmp_path, "overlap", 150, JAXCOMM_TIMEOUT_S="60")
    assert result.returncodes == [0, 0], outputs(result)
    steps = json.loads((tmp_path / "overlap0.json").read_text())
    for step in steps:
        ((device, times),) = step.items()
        assert times["grad_l0"] < times["first_collective_finished"], (device, steps)
        # The bucket finished because process 1 joined, about LATE_S after it started.
        assert times["first_collective_finished"] - times["first_collective_started"] > 0.5


@pytest.mark.timeout(200)
def test_bucket_starts_wait_for_neither_the_wire_nor_unrelated_backward(tmp_path):
    """Each bucket's start is issued as soon as its gradient exists (2 processes x 1 device).

    Event order, per step of process 0 (process 1 is LATE_S late, so process 0's first bucket
    stays on the wire until it joins): every bucket's start is queued before that first bucket
    finishes (no start waits for an earlier bucket's collective, as the last start did when
    XLA placed it after the earlier dones), and the start of the bucket of layer i is queued
    before the gradient of layer i - 2 exists (no start waits for backward work beyond the
    next layer's, which XLA:CPU's buffer reuse may put first: docs/overlap.md).
    """
    result = run(2, 1, tmp_path, "overlap", 150, JAXCOMM_TIMEOUT_S="60")
    assert result.returncodes == [0, 0], outputs(result)
    steps = json.loads((tmp_path / "overlap0.json").read_text())
    for step in steps:
        ((device, times),) = step.items()
        buckets = times["collectives"]  # issue order: l3, l2, l1, l0 (one layer per bucket)
        grads = times["grads"]
        assert len(buckets) == 4 and sorted(grads) == ["l0", "l1", "l2", "l3"], times
        first_finished = buckets[0]["finished"]
        for b, c in enumerate(buckets):
            assert c["queued"] <= c["started"], (b, times)
            assert c["queued"] < first_finished, (
                f"bucket {b} issued after bucket 0 finished",
                times,
            )
        for b, layer in ((0, "l1"), (1, "l0")):  # bucket b holds layer 3 - b
            assert buckets[b]["queued"] < grads[layer], (f"bucket {b} issued after {layer}", times)
