"""Bootstrap of the UCX world from Python: one process with 4 CPU devices, and 2 processes with
2 devices each through jax.distributed. Every scenario runs in fresh subprocesses (JAX's device
count must be set before its backends start) with a hard timeout; no child outlives a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

# Exchanges a ring message among all local ranks (one thread per rank, as XLA would) and
# between processes, then prints a line the test checks.
_CHILD = textwrap.dedent(
    """
    import sys, threading
    import jax
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    nproc, pid = int(sys.argv[2]), int(sys.argv[3])
    if nproc > 1:
        jax.distributed.initialize(coordinator_address=sys.argv[4], num_processes=nproc,
                                   process_id=pid)
    from jaxcomm import _world
    w = _world.world()
    assert w is _world.world()  # created once
    assert w.world_size == len(jax.devices()), (w, jax.devices())
    expect_local = [r for r, i in enumerate(w.device_ids)
                    if [d for d in jax.devices() if d.id == i][0].process_index == pid]
    assert list(w.local_ranks) == expect_local, w
    for d in jax.local_devices():
        assert w.rank_of_device(d) in w.local_ranks
    n = w.world_size
    got, errors = {}, []
    def ring(rank):
        try:
            payload = bytes([rank]) * (rank + 1)  # variable length
            got[rank] = w.sendrecv(rank, (rank + 1) % n, payload, (rank - 1) % n, 64,
                                   seq=1, timeout_s=30)
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=ring, args=(r,)) for r in w.local_ranks]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    for r in w.local_ranks:
        prev = (r - 1) % n
        assert got[r] == bytes([prev]) * (prev + 1), (r, got[r])
        c = w.counters(r)
        assert (c.messages_sent, c.messages_received) == (1, 1), c
        assert c.bytes_received == prev + 1, c
    print("WORLD_OK", pid, n, list(w.local_ranks), flush=True)
    """
)


def _run(args_per_process: list[list[str]], tmp_path, timeout: float) -> list[str]:
    """Starts one child per argument list; returns their outputs; kills all on any failure."""
    env = dict(os.environ, JAXCOMM_TIMEOUT_S="30", PYTHONUNBUFFERED="1")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, *args],
            cwd=tmp_path,  # not the repo root: import the installed package
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # own process group, so a kill takes its helpers too
        )
        for args in args_per_process
    ]
    outputs = []
    try:
        for child in children:
            out, _ = child.communicate(timeout=timeout)
            outputs.append(out)
            assert child.returncode == 0, out
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    return outputs


@pytest.mark.timeout(60)
def test_single_process_four_devices(tmp_path):
    (out,) = _run([["4", "1", "0"]], tmp_path, timeout=50)
    assert "WORLD_OK 0 4 [0, 1, 2, 3]" in out, out


@pytest.mark.timeout(60)
def test_two_processes_two_devices_each(tmp_path):
    from jaxcomm_launcher.backends import reserve_port

    with reserve_port() as port:  # held until the children are done: no one else can take it
        address = f"127.0.0.1:{port.getsockname()[1]}"
        outs = _run([["2", "2", str(i), address] for i in range(2)], tmp_path, timeout=50)
    assert "WORLD_OK 0 4 [0, 1]" in outs[0], outs[0]
    assert "WORLD_OK 1 4 [2, 3]" in outs[1], outs[1]


def test_world_rejects_unknown_platform():
    from jaxcomm import _world

    with pytest.raises(ValueError, match="platform must be 'cpu' or 'gpu'"):
        _world.world("tpu")


def test_gpu_world_without_gpus_fails_clearly():
    """A CPU-only jax (or a build without CUDA) gets a WorldError, not a crash."""
    import jax

    from jaxcomm import _ffi, _world

    if _ffi.has_gpu_kernels():
        try:
            jax.devices("gpu")
            pytest.skip("this machine has GPUs")
        except RuntimeError:
            pass
    with pytest.raises((_world.WorldError, RuntimeError)):
        _world.world("gpu")


def test_nccl_library_override(monkeypatch):
    from jaxcomm import config

    monkeypatch.setenv("JAXCOMM_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2")
    assert config.nccl_library_path() == "/opt/nccl/lib/libnccl.so.2"
    monkeypatch.delenv("JAXCOMM_NCCL_LIBRARY")
    found = config.nccl_library_path()
    assert found == "" or found.endswith("libnccl.so.2")
