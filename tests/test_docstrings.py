"""Every docstring example (``>>>``) of the Python code runs and prints what it shows.

The examples run against the *installed* package (the source tree has no compiled library), one
test per module, in this process (one CPU device). An example that needs what a unit test does not
have (a cluster, several processes, a launched run, a GPU) is marked ``# doctest: +SKIP`` where it
is written, which keeps it visible as documentation. The benchmark helpers are scripts, loaded
from their files.

Every example may use the names of :func:`namespace` without defining them: the usual imports
(``jax``, ``jnp``, ``np``, ``optax``, ``jaxcomm``, ``P``), a data-parallel ``mesh`` over the
devices (axis ``"dp"``), a tiny model's ``params`` (``{"layer0": {"w", "b"}}``), a batch ``x``,
``y`` (not placed: an example that shards it says how) and its ``loss(params, x, y)`` (a scalar) and ``loss_and_metric`` (loss and accuracy-like
metric, as :class:`jaxcomm.examples._loop.Step` wants).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import sys
import types

import jaxcomm_launcher
import pytest
from conftest import REPO_ROOT

import jaxcomm

SCRIPTS = [
    REPO_ROOT / "benchmarks" / name
    for name in (
        "_bench.py",
        "arm_step.py",
        "docs.py",
        "learn_windows.py",
        "overlap_job.py",
        "train.py",
        "train_grid.py",
        "train_report.py",
        "window_order.py",
    )
]


def _modules(package: types.ModuleType) -> list[str]:
    names = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        spec = importlib.util.find_spec(info.name)
        # Not __main__ (importing it runs the command) nor the compiled library.
        if not info.name.endswith("__main__") and spec.origin.endswith(".py"):
            names.append(info.name)
    return sorted(names)


MODULES = _modules(jaxcomm) + _modules(jaxcomm_launcher)


def namespace() -> dict:
    """The names every docstring example may use (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    n = jax.device_count()
    params = {
        "layer0": {
            "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
            "b": jnp.zeros((4,), jnp.float32),
        }
    }
    x = jnp.asarray(rng.standard_normal((4 * n, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4 * n, 4)), jnp.float32)

    def loss(params, x, y):  # noqa: ANN001, ANN202
        layer = params["layer0"]
        return jnp.mean((x @ layer["w"] + layer["b"] - y) ** 2)

    def loss_and_metric(params, x, y):  # noqa: ANN001, ANN202
        value = loss(params, x, y)
        return value, -value

    return {
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "optax": optax,
        "jaxcomm": jaxcomm,
        "P": P,
        "mesh": jax.make_mesh((n,), ("dp",)),
        "params": params,
        "x": x,
        "y": y,
        "loss": loss,
        "loss_and_metric": loss_and_metric,
    }


def _load_script(path):  # noqa: ANN001, ANN202
    sys.path.insert(0, str(path.parent))  # the scripts import their neighbours (_bench)
    try:
        spec = importlib.util.spec_from_file_location(f"_doctest_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass looks its module up while it is built
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _run(module: types.ModuleType) -> tuple[int, int, str]:
    """Runs the module's examples; returns (failed, attempted, report)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in finder.find(module, module.__name__):
        test.globs.update(namespace())  # fresh arrays: an example may donate them
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    return result.failed, result.attempted, "".join(report)


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as error:  # an optional extra (e.g. Orbax) is missing
        pytest.skip(f"{name}: {error}")
    failed, _, report = _run(module)
    assert failed == 0, report


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_examples(path):
    failed, attempted, report = _run(_load_script(path))
    assert attempted > 0 and failed == 0, report
