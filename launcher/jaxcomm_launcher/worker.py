"""Rank entry point: ``python -m jaxcomm_launcher.worker --spec RUN_DIR/spec.json``.

Every backend starts this module once per rank. It finds its rank and the world size in the
environment of whichever launch engine started it, keeps the memory it frees
(:mod:`jaxcomm_launcher.hostmem`), sets up JAX (the recipe's platform: CPU devices per
process, or its GPUs; ``jax.distributed``), calls the job and records how it ended.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import re
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from jaxcomm import config
from jaxcomm_launcher.hostmem import keep_freed_memory
from jaxcomm_launcher.placement import gpu_slots, visible_gpus

# (rank variable, size variable) of each launch engine, first match wins.
RANK_ENV = (
    ("JAXCOMM_PROCESS_ID", "JAXCOMM_NUM_PROCESSES"),  # local and emulated backends
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # OpenMPI mpirun
    ("PMI_RANK", "PMI_SIZE"),  # MPICH / Hydra
    ("SLURM_PROCID", "SLURM_NTASKS"),  # srun
)


def rank_and_size(env: Mapping[str, str]) -> tuple[int, int]:
    """Returns (rank, world size) from the launch engine's environment variables.

    Args:
        env: The environment, usually ``os.environ``.

    Returns:
        The rank and the number of processes.

    Raises:
        RuntimeError: When no known pair of variables is set.

    Example:
        >>> rank_and_size({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
        (1, 2)
    """
    for rank_var, size_var in RANK_ENV:
        if rank_var in env and size_var in env:
            if rank_var in config.SETTINGS:  # ours: validated, errors name the variable
                return config.get(rank_var, env), config.get(size_var, env)
            return int(env[rank_var]), int(env[size_var])
    names = ", ".join(f"{r}/{s}" for r, s in RANK_ENV)
    raise RuntimeError(f"cannot tell this process's rank: none of {names} is set")


# Each rank's index on its node under the engines that start several per node themselves.
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID")
# Backends whose ranks pick their own GPUs by local rank; local and emulated ranks are given
# theirs by the launcher (CUDA_VISIBLE_DEVICES in their environment).
SELF_PLACED = ("mpirun", "slurm")


def local_gpus(env: Mapping[str, str], devices_per_process: int, processes_per_gpu: int) -> str:
    """Returns this rank's ``CUDA_VISIBLE_DEVICES`` out of its node's visible GPUs.

    Local rank ``L`` takes the GPUs :func:`jaxcomm_launcher.placement.gpu_slots` gives it, the
    same rule the local backend applies to its ranks.

    Args:
        env: The environment (its local rank variable and ``CUDA_VISIBLE_DEVICES``).
        devices_per_process: GPUs each rank owns (``world.devices_per_process``).
        processes_per_gpu: Ranks that share each GPU (``world.processes_per_gpu``).

    Returns:
        The comma-separated GPUs.

    Raises:
        RuntimeError: No local rank variable is set, or the node shows too few GPUs.

    Example:
        >>> local_gpus({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, 2)
        '1'
    """
    var = next((v for v in LOCAL_RANK_ENV if v in env), None)
    if var is None:
        raise RuntimeError(
            f"cannot tell this rank's GPU: none of {', '.join(LOCAL_RANK_ENV)} is set"
        )
    local = int(env[var])
    visible = visible_gpus(env)
    slot = gpu_slots(local + 1, devices_per_process, processes_per_gpu)[local]
    if slot[-1] >= len(visible):
        raise RuntimeError(
            f"local rank {local} ({var}) needs GPU {slot[-1]} of its node, which shows "
            f"{len(visible)} ({','.join(visible) or 'none'}): ask the scheduler for more GPUs "
            "per node or set world.processes_per_gpu"
        )
    return ",".join(visible[i] for i in slot)


def first_host(nodelist: str) -> str:
    """Returns the first host of a Slurm host list such as ``node[07-09,12],gpu3``.

    Args:
        nodelist: ``SLURM_JOB_NODELIST`` or ``SLURM_STEP_NODELIST`` (Slurm's compact form:
            comma-separated names, each with at most one bracketed range list).

    Returns:
        The first host name, zero-padding kept (``node07``).

    Raises:
        RuntimeError: When the list is empty or not in Slurm's format.

    Example:
        >>> first_host("node[07-09,12],gpu3")
        'node07'
    """
    match = re.match(r"\s*([^,\[\]]*)(?:\[([^\]]+)\])?([^,\[\]]*)", nodelist)
    if not match or not (match.group(1) or match.group(2)):
        raise RuntimeError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0].strip() if ranges else ""
    return f"{prefix}{first}{suffix}"


def coordinator_address(env: Mapping[str, str]) -> str:
    """Returns ``host:port`` of rank 0's ``jax.distributed`` coordinator.

    ``JAXCOMM_COORDINATOR`` wins (the local, emulated and mpirun backends set it). Under
    ``srun`` rank 0 runs on the first node of the step, so the host is the first node of
    ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) and the port is
    ``JAXCOMM_COORDINATOR_PORT`` (the recipe's ``backend.port``, exported by the sbatch
    script) plus ``SLURM_STEP_ID``: each step of a sweep gets a port of its own, so a
    coordinator socket still closing from the previous step never refuses the next one.

    Args:
        env: The environment, usually ``os.environ``.

    Returns:
        The coordinator address.

    Raises:
        RuntimeError: When neither source is set, naming the variables to set.

    Example:
        >>> coordinator_address({"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[3-4]",
        ...                      "SLURM_STEP_ID": "2", "JAXCOMM_COORDINATOR_PORT": "29500"})
        'n3:29502'
    """
    if env.get("JAXCOMM_COORDINATOR"):
        return env["JAXCOMM_COORDINATOR"]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "SLURM_PROCID" in env and nodelist:
        base = config.get("JAXCOMM_COORDINATOR_PORT", env)
        if base is None:
            raise RuntimeError(
                "under srun the coordinator port comes from JAXCOMM_COORDINATOR_PORT (the "
                "sbatch script of `jaxcomm launch` exports backend.port); it is not set"
            )
        step = env.get("SLURM_STEP_ID", "0")
        port = base + (int(step) if step.isdigit() else 0)
        return f"{first_host(nodelist)}:{port}"
    raise RuntimeError(
        "JAXCOMM_COORDINATOR (host:port of rank 0) is not set, and this is not a Slurm step "
        "(SLURM_PROCID / SLURM_JOB_NODELIST)"
    )


def resolve_job(target: str) -> Callable[..., Any]:
    """Imports ``module:function`` and returns the function.

    Args:
        target: ``package.module:function``.

    Returns:
        The callable.

    Example:
        >>> resolve_job("jaxcomm_launcher.jobs.smoke:run").__name__
        'run'
    """
    module_name, _, func_name = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise AttributeError(f"job {target!r}: module {module_name} has no {func_name!r}") from None


def _write_status(run_dir: pathlib.Path, rank: int, payload: dict[str, Any]) -> None:
    tmp = run_dir / f".rank{rank}.status.tmp"
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, run_dir / f"rank{rank}.status.json")


def main(argv: list[str] | None = None) -> None:
    """Runs one rank of a launched recipe (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="jaxcomm_launcher.worker")
    parser.add_argument("--spec", required=True, help="spec.json written by the launcher")
    ns = parser.parse_args(argv)
    spec = json.loads(pathlib.Path(ns.spec).read_text())
    run_dir = pathlib.Path(spec["run_dir"])
    rank, size = rank_and_size(os.environ)
    try:
        _run(spec, run_dir, rank, size)
    except BaseException as exc:  # noqa: BLE001 - any failure must be reported, then exit
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            _write_status(
                run_dir,
                rank,
                {
                    "rank": rank,
                    "host": socket.gethostname(),
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": tb,
                },
            )
        except OSError:
            pass
        # os._exit skips jax.distributed's atexit shutdown, whose barrier would wait for the
        # other ranks (possibly forever) instead of letting the launcher stop them now.
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Same reason as above: peers may already be gone once every rank wrote its status.
    os._exit(0)


def _run(spec: dict[str, Any], run_dir: pathlib.Path, rank: int, size: int) -> None:
    from jaxcomm_launcher.context import JobContext, MetricsLogger
    from jaxcomm_launcher.recipe import LIGHT, JaxcommSettings, Recipe

    keep_freed_memory(os.environ)

    # The launcher checked the job's args; a training job's check imports its example, which
    # must wait until JAX is set up for this rank's platform (_setup_jax).
    recipe = Recipe.model_validate(spec["recipe"], context={LIGHT: True})
    settings = JaxcommSettings.model_validate(spec["jaxcomm"])
    if size != recipe.world.processes:
        raise RuntimeError(
            f"the launch engine started {size} processes but the recipe asks for "
            f"world.processes={recipe.world.processes}"
        )

    jax = _setup_jax(recipe)
    if size > 1:
        coordinator = coordinator_address(os.environ)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=size,
            process_id=rank,
            initialization_timeout=config.get("JAXCOMM_INIT_TIMEOUT"),
        )
    _check_devices(jax, recipe)
    job = resolve_job(spec["job"])
    metrics = MetricsLogger(
        run_dir / f"rank{rank}.jsonl", rank, spec["variant"], recipe.metrics.log_every
    )
    ctx = JobContext(
        rank=rank,
        world_size=size,
        devices_per_process=recipe.world.devices_per_process,
        run_dir=run_dir,
        metrics=metrics,
        recipe=recipe,
        jaxcomm=settings,
        variant=spec["variant"],
    )
    try:
        job(ctx)
    finally:
        metrics.close()
    _write_status(run_dir, rank, {"rank": rank, "host": socket.gethostname(), "ok": True})
    if size > 1:
        # A clean shutdown waits for every rank to finish its collectives.
        jax.distributed.shutdown()


def _setup_jax(recipe: Any) -> Any:
    """Imports JAX on the recipe's platform; must run before any JAX backend starts."""
    world = recipe.world
    if world.platform == "gpu" and recipe.backend.kind in SELF_PLACED:
        os.environ["CUDA_VISIBLE_DEVICES"] = local_gpus(
            os.environ, world.devices_per_process, world.processes_per_gpu
        )
    import jax

    if world.platform == "gpu":
        # CUDA first (the default device), the host's CPU for host-side work. JAX skips a
        # platform it has no plugin for: _check_devices fails such a rank instead of letting
        # it train on the CPU.
        jax.config.update("jax_platforms", "cuda,cpu")
    else:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", world.devices_per_process)
    return jax


def _check_devices(jax: Any, recipe: Any) -> None:
    """Fails when this rank is not on the recipe's platform or got another number of devices
    than the recipe gives it."""
    if recipe.world.platform == "gpu" and jax.default_backend() != "gpu":
        raise RuntimeError(
            "world.platform is gpu but JAX found no CUDA GPU here (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): install jax[cuda13] or "
            "jax[cuda12], or use world.platform: cpu"
        )
    have, want = jax.local_device_count(), recipe.world.devices_per_process
    if have != want:
        raise RuntimeError(
            f"this rank has {have} {jax.default_backend()} devices but "
            f"world.devices_per_process={want} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )


if __name__ == "__main__":
    main()
