"""Failure behaviour across processes: a dead peer or mismatched shapes fail fast, no hang."""

from __future__ import annotations

import pytest
from collectives_harness import run_world


@pytest.mark.timeout(180)
def test_killed_peer_makes_the_others_fail_within_the_timeout(tmp_path):
    run = run_world(2, 1, tmp_path, mode="die", timeout=150, env={"JAXCOMM_TIMEOUT_S": "20"})
    survivor = run.outputs[0]
    assert run.returncodes[1] == -9
    assert run.returncodes[0] == 3, survivor[-3000:]
    assert "COLLECTIVE FAILED" in survivor
    assert "jaxcomm.allreduce" in survivor
    assert "rank 1" in survivor or "peer 1" in survivor, survivor[-3000:]


@pytest.mark.timeout(180)
def test_shared_memory_waits_see_a_dead_peer_process_exit(tmp_path):
    # One host: the allreduce's notices go through shared memory, not UCX
    # (ffi/transport/ucx_world.h, "Notices"). Rank 1 dies while ranks 0 and 2 wait for its
    # notice; they must see its process exit and name it, not wait out the (long) deadline.
    run = run_world(3, 1, tmp_path, mode="die", timeout=150, env={"JAXCOMM_TIMEOUT_S": "600"})
    assert run.returncodes[1] == -9
    for survivor in (0, 2):
        out = run.outputs[survivor]
        assert run.returncodes[survivor] == 3, out[-3000:]
        assert "jaxcomm.allreduce" in out and "peer rank 1 failed (its process" in out, out[-3000:]
        assert "exited" in out and "deadline" not in out, out[-3000:]


@pytest.mark.timeout(180)
def test_mismatched_shapes_across_processes_are_reported(tmp_path):
    run = run_world(2, 1, tmp_path, mode="mismatch", timeout=150, env={"JAXCOMM_TIMEOUT_S": "20"})
    assert all(code == 3 for code in run.returncodes), run.outputs
    assert any("same shape" in out or "truncat" in out.lower() for out in run.outputs), run.outputs
