"""Regression for issue 11: Adaptive(π = 64), LBANN's own setting, diverged on a wide MLP.

On 64 -> 1024 -> 1024 -> 1024 -> 10 (4 CPU devices, SGD lr 0.05 momentum 0.9, batch 40) the
loss of adaptive grew from step ~40 and reached NaN within ~80-100 steps, because the quantized
allreduce's owner requantized the sparse sum keeping 1/π of its nonzeros only (see
kernels/adaptive.h AdaptiveSignKeep). Here adaptive must stay finite, keep learning, and end
close to the dense run of the same length.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
from collectives_harness import run_script

WORKER = pathlib.Path(__file__).with_name("adaptive_training_worker.py")
STEPS = 150
# Before the fix adaptive's loss was 9.3 at step 99 and growing. Adaptive still lags dense
# this early (a NumPy simulation of the same loop reaches 97-98 % by step 400), by how much
# depends on the installed packages: 6 points on 2026-11-22, 16 points with jax 0.10.2,
# numpy 2.4 and scikit-learn 1.9 (the same with the code of either date), hence the tolerance.
ACCURACY_TOLERANCE = 0.20


# The worker's own 900 s bound, not pytest's default 300 s, decides (3 trainings of 150 steps
# take minutes on a busy 2-core machine).
@pytest.mark.slow  # three trainings: CI runs it with `pytest -m slow`
@pytest.mark.timeout(960)
def test_adaptive_pi64_trains_the_wide_mlp_like_dense(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "runs.json"
    proc = run_script(WORKER, "--steps", STEPS, "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = json.loads(out.read_text())
    adaptive, dense = runs["adaptive"], runs["dense"]
    losses = [h["loss"] for h in adaptive["history"]]
    assert all(math.isfinite(v) for v in losses), losses
    # It learns and does not blow up (the bug: loss > 5 by step 90 and growing).
    assert max(losses[len(losses) // 2 :]) < 1.5, losses
    assert adaptive["train_loss"] < 0.5 * losses[0], losses
    assert adaptive["test_accuracy"] >= dense["test_accuracy"] - ACCURACY_TOLERANCE, (
        adaptive["test_accuracy"],
        dense["test_accuracy"],
    )
