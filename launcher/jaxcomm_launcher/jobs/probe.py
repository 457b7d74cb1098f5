"""``probe``: the recipe's world measured for the cost model, written as a profile.

``jaxcomm probe RECIPE --out profile.json`` runs this job on the recipe's own world (its
processes, devices per process and backend), so the numbers include what that world adds:
several ranks sharing cores, loopback or a shaped network. The measurement is the library's
(:func:`jaxcomm.cost.probe.probe_world`: links, ``lax.psum``, the call overhead and every
kernel's gamma calibrated inside its collective); this job only hands it the recipe's
``args`` and writes what it returns.

Recipe ``args`` (all optional; declared in ``jobs/args.py``, ``ProbeArgs``): sizes (ring/psum
elements per rank), kernel_elements, repeats (the median is kept), out (a path rank 0 also
writes the profile to, replacing an older one only once the new one is written). The profile
goes to ``profile.json`` in the run directory.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from typing import Any

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs.args import ProbeArgs


def _write(paths: list[pathlib.Path], data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2) + "\n"
    for path in paths:
        # Whole or not at all: a profile already there stays until the new one is complete.
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _print_profile(ctx: JobContext, profile: Any) -> None:
    for name, link in profile.links.items():
        ctx.print(
            f"probe link {name:13s} alpha {link.alpha * 1e6:9.2f} us  "
            f"beta {link.beta * 1e9:8.4f} ns/B ({1 / max(link.beta, 1e-30) / 1e9 * 8:8.2f} Gbit/s)"
            + ("" if f"links.{name}" in profile.measured else "  [default]")
        )
    ctx.print(f"probe call overhead {profile.call * 1e6:9.2f} us")
    for name, g in profile.gamma.items():
        ctx.print(f"probe gamma {name:20s} {g * 1e9:8.3f} ns/element")


def run(ctx: JobContext) -> None:
    """Measures this world (every rank); rank 0 writes ``profile.json`` and ``args.out``.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; rank 0 writes ``profile.json`` (and ``args.out`` when given).

    Example:
        >>> # jaxcomm probe recipes/digits-dense.yaml --out profile.json
    """
    import jax

    from jaxcomm import cost
    from jaxcomm.cost.probe import probe_world

    args = ProbeArgs.model_validate(ctx.args)  # the recipe validator checked them already
    data = probe_world(args.sizes, args.kernel_elements, args.repeats)
    if not ctx.is_main:
        return
    kind, processes = ctx.recipe.backend.kind, jax.process_count()
    world = {"processes": processes, "devices_per_process": ctx.devices_per_process,
             "backend": kind}  # fmt: skip
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    source = (
        f"jaxcomm probe of recipe {ctx.recipe.name} ({kind}, "
        f"{processes} processes x {ctx.devices_per_process} devices, {now})"
    )
    profile = cost.Profile.from_json({**data, "source": source})  # validates; fills defaults
    paths = [ctx.run_dir / "profile.json", *([pathlib.Path(args.out)] if args.out else [])]
    _write(paths, {**profile.to_json(), "world": world, "samples": data["samples"]})
    _print_profile(ctx, profile)
    ctx.print(f"probe profile written to {', '.join(str(p) for p in paths)}")
