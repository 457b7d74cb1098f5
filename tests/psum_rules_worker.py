"""jaxcomm.allreduce under jax.grad and jax.vmap against lax.psum, in one process of N CPU
devices (run by tests/test_allreduce.py: ``python psum_rules_worker.py N``).

jaxcomm.allreduce's result is typed varying over the reduced axes, as lax.psum's is without
the varying-manual-axes check (``check_vma=False``: psum + pbroadcast, whose transpose is a
psum); with the check on, it equals ``lax.pcast(lax.psum(x), to="varying")`` and equals a bare
``lax.psum`` wherever its result feeds per-device (varying) values. Every case below compares
values, gradients and batched results with those references and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

AXIS = "dp"


def psum_varying(x: jax.Array, axis: str) -> jax.Array:
    """lax.psum with the result cast back to varying: psum + pbroadcast."""
    return lax.pcast(lax.psum(x, axis), axis, to="varying")


def check(name: str, ours: jax.Array, reference: jax.Array, dtype: str = "float32") -> None:
    tol = 1e-5 if dtype == "float32" else 2e-2
    a = np.asarray(jnp.asarray(ours, jnp.float32))
    b = np.asarray(jnp.asarray(reference, jnp.float32))
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert np.abs(b).max() > 0, f"{name}: the reference is all zeros, the case checks nothing"
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
    print(f"ok {name}", flush=True)


def main() -> None:
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), (AXIS,))
    spec = P(AXIS)
    rng = np.random.default_rng(0)
    x = jax.device_put(
        rng.standard_normal((devices, 6)).astype(np.float32), NamedSharding(mesh, spec)
    )
    w = jax.device_put(
        rng.standard_normal((devices, 6)).astype(np.float32), NamedSharding(mesh, spec)
    )

    def per_device(fn, check_vma: bool = True, n_in: int = 1):
        specs = spec if n_in == 1 else (spec,) * n_in
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=check_vma)
        )

    for check_vma in (True, False):
        refs = {"psum": lax.psum} if not check_vma else {"pcast(psum)": psum_varying}
        for ref_name, ref in refs.items():
            tag = f"[check_vma={check_vma}, vs {ref_name}]"

            # A loss summed over devices as per-device values (what a data-parallel step does).
            def loss(red, v, w):
                s = red(v * v, AXIS)
                return jnp.sum(jnp.sin(s) * w + s * s)

            for red_name, arg in (("grad x", 0), ("grad w", 1)):
                ours = per_device(
                    lambda v, w, a=arg: jax.grad(lambda *p: loss(jaxcomm.allreduce, *p), argnums=a)(
                        v, w
                    ),
                    check_vma,
                    2,
                )(x, w)
                theirs = per_device(
                    lambda v, w, a=arg, r=ref: jax.grad(lambda *p: loss(r, *p), argnums=a)(v, w),
                    check_vma,
                    2,
                )(x, w)
                check(f"{red_name} {tag}", ours, theirs)

            # A loss of the reduced value alone (no per-device factor).
            ours = per_device(
                lambda v: jax.grad(lambda r: jnp.sum(jnp.cos(jaxcomm.allreduce(r, AXIS))))(v),
                check_vma,
            )(x)
            theirs = per_device(
                lambda v, r=ref: jax.grad(lambda q: jnp.sum(jnp.cos(r(q, AXIS))))(v), check_vma
            )(x)
            check(f"grad of a reduced loss {tag}", ours, theirs)

            # Second-order: the gradient of a gradient goes through the rule twice.
            def twice(red, v):
                g = jax.grad(lambda q: jnp.sum(red(q**3, AXIS) ** 2))
                return jax.grad(lambda q: jnp.sum(g(q) ** 2))(v)

            ours = per_device(lambda v: twice(jaxcomm.allreduce, v), check_vma)(x)
            theirs = per_device(lambda v, r=ref: twice(r, v), check_vma)(x)
            check(f"grad of grad {tag}", ours, theirs)

            # vmap over a batch inside each device: one allreduce of the stacked rows.
            def rows(red, v):
                return jax.vmap(lambda r: red(r * 2.0, AXIS))(v.reshape(3, 2)).reshape(1, 6)

            ours = per_device(lambda v: rows(jaxcomm.allreduce, v), check_vma)(x)
            theirs = per_device(lambda v, r=ref: rows(r, v), check_vma)(x)
            check(f"vmap {tag}", ours, theirs)

            # vmap with the batch on another axis, and vmap of grad, and grad of vmap.
            def cols(red, v):
                return jax.vmap(lambda c: red(c, AXIS), in_axes=1, out_axes=1)(
                    v.reshape(2, 3)
                ).reshape(1, 6)

            ours = per_device(lambda v: cols(jaxcomm.allreduce, v), check_vma)(x)
            theirs = per_device(lambda v, r=ref: cols(r, v), check_vma)(x)
            check(f"vmap in_axes=1 {tag}", ours, theirs)

            def vmap_grad(red, v):
                g = jax.grad(lambda r: jnp.sum(jnp.cos(red(r, AXIS))))
                return jax.vmap(g)(v.reshape(3, 2)).reshape(1, 6)

            ours = per_device(lambda v: vmap_grad(jaxcomm.allreduce, v), check_vma)(x)
            theirs = per_device(lambda v, r=ref: vmap_grad(r, v), check_vma)(x)
            check(f"vmap of grad {tag}", ours, theirs)

            def grad_vmap(red, v):
                f = jax.vmap(lambda r: jnp.sum(red(r * r, AXIS) ** 2))
                return jax.grad(lambda q: jnp.sum(f(q.reshape(3, 2))))(v)

            ours = per_device(lambda v: grad_vmap(jaxcomm.allreduce, v), check_vma)(x)
            theirs = per_device(lambda v, r=ref: grad_vmap(r, v), check_vma)(x)
            check(f"grad of vmap {tag}", ours, theirs)

    # With the check on, a bare lax.psum: same gradient wherever the sum feeds per-device
    # values (the data-parallel case above), and the same batched values.
    ours = per_device(
        lambda v, w: jax.grad(lambda q: jnp.sum(jaxcomm.allreduce(q, AXIS) * w))(v), n_in=2
    )(x, w)
    theirs = per_device(lambda v, w: jax.grad(lambda q: jnp.sum(lax.psum(q, AXIS) * w))(v), n_in=2)(
        x, w
    )
    check("grad vs bare psum [check_vma=True]", ours, theirs)

    # The backward sum runs on jaxcomm too (not an XLA psum), and a vmapped call is one
    # collective for the whole batch: count the calls each rank made.
    def calls(fn, *args) -> int:
        jax.block_until_ready(fn(*args))  # compiled and warm
        jaxcomm.reset_metrics()
        jax.block_until_ready(fn(*args))
        return sum(t["calls"] for t in jaxcomm.metrics()["totals"])

    step = per_device(
        lambda v, w: jax.grad(lambda q: jnp.sum(jaxcomm.allreduce(q, AXIS) * w))(v), n_in=2
    )
    assert calls(step, x, w) == 2 * devices, "forward + backward: two calls per rank"
    batched = per_device(lambda v: rows(jaxcomm.allreduce, v))
    assert calls(batched, x) == devices, "one call per rank for the whole vmapped batch"
    print("ok call counts", flush=True)

    # bfloat16 (the 16-bit wire forward and backward) and the split call (`after`).
    xb = x.astype(jnp.bfloat16)
    ours = per_device(
        lambda v, w: jax.grad(
            lambda q: jnp.sum(jaxcomm.allreduce(q, AXIS).astype(jnp.float32) * w)
        )(v),
        n_in=2,
    )(xb, w)
    theirs = per_device(
        lambda v, w: jax.grad(lambda q: jnp.sum(psum_varying(q, AXIS).astype(jnp.float32) * w))(v),
        n_in=2,
    )(xb, w)
    check("grad bfloat16", ours, theirs, dtype="bfloat16")
    ours = per_device(
        lambda v, w: jax.grad(lambda q: jnp.sum(jaxcomm.allreduce(q, AXIS, after=w * 2) * w))(v),
        n_in=2,
    )(x, w)
    theirs = per_device(
        lambda v, w: jax.grad(lambda q: jnp.sum(psum_varying(q, AXIS) * w))(v), n_in=2
    )(x, w)
    check("grad with after=", ours, theirs)
    # A split call sums in place (its result takes x's buffer): x read again after the call
    # must still be x (XLA copies it first), in float32 and on the 16-bit wire.
    for dtype in ("float32", "bfloat16"):
        xd = x.astype(dtype)
        ours = per_device(lambda v, w: jaxcomm.allreduce(v, AXIS, after=w * 2) + v * w, n_in=2)(
            xd, w.astype(dtype)
        )
        theirs = per_device(lambda v, w: psum_varying(v, AXIS) + v * w, n_in=2)(xd, w.astype(dtype))
        check(f"split {dtype} with its operand read after it", ours, theirs, dtype=dtype)
    print("done", flush=True)


if __name__ == "__main__":
    main()
