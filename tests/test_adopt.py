"""The five-line adoption: a plain data-parallel JAX loop and its jaxcomm version
(jaxcomm/examples/adopt_plain.py, adopt_jaxcomm.py) differ by at most five lines and train
scikit-learn's digits on 2 devices to the same test accuracy."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

PLAIN = REPO_ROOT / "jaxcomm" / "examples" / "adopt_plain.py"
JAXCOMM = REPO_ROOT / "jaxcomm" / "examples" / "adopt_jaxcomm.py"
MOST_CHANGED_LINES = 5
ACCURACY_POINTS = 0.5  # the two runs' test accuracy, in percentage points


def changed_lines(a: str, b: str) -> list[str]:
    """Every line `diff` marks removed (-) or added (+), blank ones included."""
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
    return [x for x in diff if x[:1] in "+-" and x[:3] not in ("---", "+++")]


def test_changed_lines_counts_a_replaced_line_twice_and_a_blank_one():
    assert changed_lines("a\nb\nc\n", "a\nB\n\nc\nd\n") == ["-b", "+B", "+", "+d"]


def test_the_jaxcomm_loop_changes_at_most_five_lines_of_the_plain_one():
    changed = changed_lines(PLAIN.read_text(), JAXCOMM.read_text())
    assert 0 < len(changed) <= MOST_CHANGED_LINES, "\n".join(changed)


@pytest.fixture(scope="module")
def accuracies(tmp_path_factory):
    # `python -m` puts the working directory first on sys.path: run outside the repository so
    # that the installed package (with its compiled library) is the one imported.
    outside = tmp_path_factory.mktemp("adopt")
    out = {}
    for program in (PLAIN, JAXCOMM):
        module = f"jaxcomm.examples.{program.stem}"
        run = subprocess.run(
            [sys.executable, "-m", module, "--devices", "2"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=outside,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        out[program.stem] = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow  # two trainings on digits: CI runs it with `pytest -m slow`
def test_both_loops_train_digits_to_the_same_accuracy(accuracies):
    plain = accuracies["adopt_plain"]["test_accuracy"]
    ours = accuracies["adopt_jaxcomm"]["test_accuracy"]
    assert plain > 0.9, accuracies  # the loop learns at all
    assert abs(plain - ours) * 100 <= ACCURACY_POINTS, accuracies
    # The loss each returns is the global batch's mean, not one rank's.
    assert abs(accuracies["adopt_plain"]["loss"] - accuracies["adopt_jaxcomm"]["loss"]) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("example", ["flax_nnx", "flax_linen"])
def test_flax_examples_train_digits_through_data_parallel_step(example, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", f"jaxcomm.examples.{example}", "--devices", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # outside the repository, as in `accuracies`
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert result["test_accuracy"] > 0.9, result
