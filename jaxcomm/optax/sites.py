"""DiLoCo over sites: a worker is a site of many devices, not one device.

The mesh has an outer axis, the slow link between sites (e.g. ``"node"``), and an inner axis,
the devices of one site (e.g. ``"local"``). Inside a site the devices train as one worker:

* data-parallel (``params_sharded=False``): each device holds the site's whole θ_local; the
  gradients are averaged over the inner axis every step, so θ_local stays one, identical on
  the site's devices. Δ is then identical on them too, and each device exchanges only its
  1/L share of it over the outer axis (a contiguous slice of the flat fragment), then the
  site gathers the averaged shares over the inner axis (fast links, :func:`whole`);
* sharded (``params_sharded=True``, FSDP-style): each device holds its own shard of every
  parameter and of the inner optimizer's state, and its gradient is already the site's
  gradient of that shard (the transpose of the forward's all-gather summed it); its share of
  the outer exchange is its own parameter shard, and nothing is gathered.

Either way a device's error feedback covers its own share, and the outer average is over the
outer axis only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import allreduce

INNER_ALLREDUCES = ("auto", "psum", "dense")
"""How a data-parallel site averages its gradients every step: ``psum`` (XLA's collective),
``dense`` (jaxcomm's allreduce), ``auto`` (the one the cost model predicts faster)."""


@dataclasses.dataclass(frozen=True)
class Sites:
    """Where the devices of one DiLoCo worker are (see :func:`jaxcomm.optax.diloco`).

    Attributes:
      outer: the axis (or axes) between sites, which the outer step averages over.
      inner: the axis of a site's devices.
      params_sharded: the parameters and inner state are sharded over ``inner``.
      inner_allreduce: one of :data:`INNER_ALLREDUCES`.
    """

    outer: Any
    inner: str
    params_sharded: bool = False
    inner_allreduce: str = "auto"

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis a per-device state leaf is split over: the outer ones, then the inner."""
        outer = (self.outer,) if isinstance(self.outer, str) else tuple(self.outer)
        return (*outer, self.inner)


def make(
    axis_name: Any, inner_axis: Any, params_sharded: bool, inner_allreduce: str
) -> Sites | None:
    """The checked :class:`Sites` of a :func:`diloco` call, or None without an inner axis."""
    if inner_axis is None:
        if params_sharded:
            raise ValueError(
                "diloco: params_sharded=True needs inner_axis, the mesh axis the parameters "
                "are sharded over (e.g. inner_axis='local')"
            )
        return None
    if not isinstance(inner_axis, str) or not inner_axis:
        raise TypeError(
            f"diloco: inner_axis must be one mesh axis name (the devices of a site, e.g. "
            f"'local'), got {inner_axis!r}"
        )
    outer = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if inner_axis in outer:
        raise ValueError(
            f"diloco: inner_axis {inner_axis!r} is also in axis_name {axis_name!r}; axis_name "
            "is the axis between sites (e.g. 'node'), inner_axis the devices of one site "
            "(e.g. 'local')"
        )
    if inner_allreduce not in INNER_ALLREDUCES:
        raise ValueError(
            f"diloco: inner_allreduce must be one of {INNER_ALLREDUCES}, got {inner_allreduce!r}"
        )
    return Sites(axis_name, inner_axis, bool(params_sharded), inner_allreduce)


def check_mesh(sites: Sites) -> None:
    """Inside the shard_map: a ValueError naming the argument whose axis the mesh lacks.

    Outside one (``jax.eval_shape(tx.init, params)`` for :func:`partition_specs`) there is no
    mesh to check, and nothing is reduced.
    """
    mesh = jax.sharding.get_abstract_mesh()
    mesh_axes = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if not manual:
        return
    outer = (sites.outer,) if isinstance(sites.outer, str) else tuple(sites.outer)
    named = [("axis_name", a) for a in outer] + [("inner_axis", sites.inner)]
    for argument, name in named:
        if name not in mesh_axes or name not in manual:
            raise ValueError(
                f"diloco: {argument}={name!r} is not a manual axis of the enclosing shard_map "
                f"(mesh axes {mesh_axes}); pass one of them"
            )


def size(name: str) -> int | None:
    """The size of mesh axis ``name``: inside the shard_map, or under ``jax.set_mesh``; None
    where no mesh says (a bare ``jax.eval_shape``)."""
    mesh = jax.sharding.get_abstract_mesh()
    found = dict(getattr(mesh, "shape", {}) or {}).get(name)
    return None if found is None else int(found)


def check_shapes_known(sites: Sites | None, streamed: bool) -> None:
    """A ValueError naming the fix where the state's structure needs the inner axis' size and
    no mesh gives it: a streamed exchange's handle records the shape of its device's share."""
    if sites is None or sites.params_sharded or not streamed or size(sites.inner) is not None:
        return
    raise ValueError(
        f"diloco: over sites with a streamed outer exchange, the state holds each device's "
        f"share of Δ, whose size depends on inner_axis={sites.inner!r}; build the state (or "
        "its jax.eval_shape) inside the shard_map or under `with jax.set_mesh(mesh):`"
    )


def share_length(sites: Sites | None, n: int) -> int:
    """Elements of a device's share of an ``n``-element fragment of Δ."""
    if sites is None or sites.params_sharded:
        return n
    return -(-n // (size(sites.inner) or 1))  # no mesh: shapes only (check_shapes_known)


def own_share(sites: Sites | None, delta: jax.Array) -> jax.Array:
    """This device's share of the flat Δ (data-parallel site: slice ``i`` of L, zero-padded)."""
    if sites is None or sites.params_sharded:
        return delta
    share = share_length(sites, delta.shape[0])
    padded = jnp.pad(delta, (0, share * size(sites.inner) - delta.shape[0]))
    return lax.dynamic_slice(padded, (lax.axis_index(sites.inner) * share,), (share,))


def whole(sites: Sites | None, share: jax.Array, n: int) -> jax.Array:
    """The flat ``n``-element average from every device's averaged share, gathered inside the
    site: bit-identical on its devices, since each share is.

    The gather is jaxcomm's dense allreduce over the inner axis of the shares, each in its
    own slot of a zero vector (adding zeros is exact). An XLA all-gather here would depend on
    the exchange's result, and XLA:CPU runs a custom call's dependents on the thread that
    completes it: jaxcomm's one completer thread would then wait in XLA's rendezvous for the
    devices whose exchanges it has still to complete.
    """
    if sites is None or sites.params_sharded:
        return share
    slots = jnp.zeros((size(sites.inner), share.shape[0]), share.dtype)
    slots = slots.at[lax.axis_index(sites.inner)].set(share)
    return allreduce(slots.reshape(-1), sites.inner)[:n]


def average_gradients(sites: Sites | None, grads: Any) -> Any:
    """The site's mean gradient on each of its devices (data-parallel); as given otherwise."""
    if sites is None or sites.params_sharded:
        return grads
    leaves, treedef = jax.tree.flatten(grads)
    if not leaves:
        return grads
    devices = size(sites.inner)
    n = sum(int(x.size) for x in leaves)
    if _inner_allreduce(sites, n, devices) == "psum":
        return jax.tree.map(lambda g: lax.psum(g, sites.inner) / devices, grads)
    # One jaxcomm allreduce per dtype: each dtype's leaves raveled into one vector.
    out: list[Any] = [None] * len(leaves)
    for dtype in sorted({x.dtype.name for x in leaves}):
        idx = [i for i, x in enumerate(leaves) if x.dtype.name == dtype]
        summed = allreduce(jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]), sites.inner)
        offset = 0
        for i in idx:
            x = leaves[i]
            out[i] = (summed[offset : offset + x.size].reshape(x.shape) / devices).astype(x.dtype)
            offset += x.size
    return jax.tree.unflatten(treedef, out)


def _inner_allreduce(sites: Sites, n: int, devices: int) -> str:
    """psum or dense: the named one, or for auto the one the cost model predicts faster on a
    site's devices (one host)."""
    if sites.inner_allreduce != "auto":
        return sites.inner_allreduce
    from jaxcomm.cost.model import World
    from jaxcomm.cost.timemodel import predict

    world = World(1, devices)
    seconds = {name: predict(name, n, world).seconds for name in ("dense", "psum")}
    return min(seconds, key=lambda name: seconds[name])
