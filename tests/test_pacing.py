"""jaxcomm.paced and jaxcomm.pacing's helpers on one device (multi-device loops: test_async_loops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxcomm
from jaxcomm import pacing


def test_paced_keeps_at_most_max_in_flight_and_returns_the_same_values():
    step = jax.jit(lambda x: x * 2.0 + 1.0)
    paced = jaxcomm.paced(step, max_in_flight=2)
    x = plain = jnp.ones(4)
    for _ in range(10):
        x = paced(x)
        plain = step(plain)
        assert paced.in_flight <= 2
    paced.wait()
    assert paced.in_flight == 0
    assert jnp.array_equal(x, plain)


def test_paced_waits_for_a_later_step_when_outputs_were_donated():
    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    paced = jaxcomm.paced(step, max_in_flight=1)
    x = jnp.zeros(3)
    for _ in range(5):
        x = paced(x)  # the previous step's only output is donated to this one
        assert paced.in_flight <= 1
    paced.wait()
    assert float(x[0]) == 5.0


def test_max_in_flight_must_be_non_negative():
    with pytest.raises(ValueError, match="max_in_flight"):
        jaxcomm.paced(lambda x: x, max_in_flight=-1)


def test_short_message_drops_the_dispatch_chain():
    chain = "INTERNAL: " + "Error dispatching computation: " * 500 + "jaxcomm.allreduce #3: x"
    assert pacing.short_message(RuntimeError(chain)) == "jaxcomm.allreduce #3: x"


def test_launch_pool_threads_cover_two_per_device():
    assert pacing.cpu_launch_threads(4) >= 10
    assert pacing.cpu_launch_threads(1) >= 4


# What each subprocess does before JAX creates its CPU client of 3 devices; the pool must be
# sized whichever of jaxcomm and JAX comes first (import jaxcomm is light: it hooks the sizing
# in when JAX is imported).
_ORDERS = {
    "jaxcomm_then_jax": "import jaxcomm\nimport jax\n",
    "jax_then_jaxcomm": "import jax\nimport jaxcomm\n",
    "cost_only_then_jax": "import jaxcomm.cost\nimport jax\n",
}


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_import_sizes_the_launch_pool_before_the_cpu_client(order):
    import os
    import subprocess
    import sys

    code = (
        _ORDERS[order] + "jax.config.update('jax_num_cpu_devices', 3)\n"
        "assert len(jax.devices()) == 3\n"
        "import os\n"
        "from jaxcomm import pacing\n"
        "assert os.environ['PJRT_NPROC'] == str(pacing.cpu_launch_threads(3)), os.environ\n"
        "print('sized')\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        env={**environ, "JAX_PLATFORMS": "cpu"},
        timeout=240,
    )
    assert done.returncode == 0 and done.stdout.strip() == "sized", done.stderr[-3000:]
