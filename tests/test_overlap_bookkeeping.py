"""allreduce_gradients(overlap=True) keeps its books whatever JAX caches and the platform splits.

The overlapped step notes, per bucket, whether its collective was split; it failed at trace
time on GPU ("a bucket's collective was not issued") when the note was made inside a body
that jax >= 0.11 traces once for several buckets of one type. The worker fakes both that
cache and a platform whose handlers do not split, on CPU devices.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("overlap_bookkeeping_worker.py")


@pytest.mark.parametrize("no_split", [False, True], ids=["splits", "does-not-split"])
@pytest.mark.parametrize(
    "cached_trace",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["traced-each-call", "cached-trace"],
)
def test_overlapped_step_equals_unsplit_step(cached_trace, no_split):
    flags = ["--cached-trace"] * cached_trace + ["--no-split"] * no_split
    run = subprocess.run(
        [sys.executable, str(WORKER), *flags], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["equal"]  # bit-identical parameters after 3 AdamW steps
    assert result["plain_dones"] == 0
    if no_split:
        assert result["split_dones"] == 0  # every bucket ran whole
    else:
        assert result["split_dones"] >= 2  # several buckets in flight
