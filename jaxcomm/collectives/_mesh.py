"""Where a collective call sits in the mesh: axis names, sizes and this device's coordinates.

Inside shard_map the device program does not know the concrete devices of its mesh, only the
abstract mesh (axis names and sizes). The FFI handler learns its own device from XLA
(DeviceOrdinal, the global device id on CPU) and receives its mesh coordinates as an operand;
the first collective over a mesh shape exchanges (device, coordinates) among all ranks once,
after which each handler knows the members of its group in rank order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class AxisLayout:
    """A collective's view of the mesh, computed at trace time.

    Attributes:
      axis_names: every axis of the enclosing mesh, in mesh order.
      axis_sizes: their sizes.
      reduce_mask: 1 for each axis the collective reduces over, else 0.
      group_size: product of the reduced axes' sizes (P).
      platform: ``"cpu"`` or ``"gpu"``: the devices of the mesh, which pick the world (and
        XLA picks the handler of the same platform).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    reduce_mask: tuple[int, ...]
    platform: str = "cpu"

    @property
    def group_size(self) -> int:
        return int(
            np.prod([s for s, m in zip(self.axis_sizes, self.reduce_mask, strict=True) if m])
        )

    def attributes(self) -> dict[str, np.ndarray]:
        """FFI attributes describing the layout (int64 arrays)."""
        return {
            "mesh_axis_sizes": np.asarray(self.axis_sizes, np.int64),
            "reduce_axes": np.asarray(self.reduce_mask, np.int64),
        }

    def coordinates(self) -> jax.Array:
        """This device's coordinate along every mesh axis, as an int32 vector operand."""
        return jnp.stack([lax.axis_index(name) for name in self.axis_names]).astype(jnp.int32)


def resolve(axis_name: str | Sequence[str], api: str) -> AxisLayout:
    """Checks `axis_name` against the enclosing shard_map mesh and returns the layout.

    Args:
      axis_name: a mesh axis name or a sequence of them (reduced jointly, in mesh order).
      api: the public function's name, for error messages.

    Returns:
      The AxisLayout of the call.

    Raises:
      ValueError: outside shard_map, or an axis that the mesh does not have.
    """
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{api}: axis_name must be a mesh axis name or a tuple of names, got {axis_name!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: axis_name {names} repeats an axis")
    mesh = jax.sharding.get_abstract_mesh()
    mesh_axes = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if not mesh_axes or not manual:
        raise ValueError(
            f"{api} must be called inside jax.shard_map (with the mesh axis it reduces over as "
            f"a manual axis); it was called outside shard_map with axis_name={axis_name!r}"
        )
    for name in names:
        if name not in mesh_axes:
            raise ValueError(
                f"{api}: unknown axis_name {name!r}; the enclosing mesh has axes {mesh_axes}"
            )
        if name not in manual:
            raise ValueError(
                f"{api}: axis {name!r} is not a manual axis of the enclosing shard_map"
            )
    # Coordinates are only available for manual axes; a partially-manual shard_map reduces
    # within the manual sub-mesh.
    names_in_order = tuple(a for a in mesh_axes if a in manual)
    sizes = tuple(int(mesh.shape[a]) for a in names_in_order)
    mask = tuple(int(a in names) for a in names_in_order)
    return AxisLayout(names_in_order, sizes, mask, _platform(mesh))


def _platform(mesh: object) -> str:
    """ "cpu" or "gpu" for the devices of `mesh` (the default backend when it does not say)."""
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return "cpu" if platform == "cpu" else "gpu"


def group_size(axis_name: str | Sequence[str]) -> int:
    """The number of ranks a reduction over ``axis_name`` spans (inside ``jax.shard_map``).

    Args:
      axis_name: a mesh axis name or a sequence of them.

    Returns:
      The product of the axes' sizes.
    """
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(lax.axis_size(n) for n in names)
