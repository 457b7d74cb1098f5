"""Atomic, numbered training checkpoints in one directory (what a restarted run resumes from).

A checkpoint is ``<dir>/step_<N>``: the state after ``N`` optimizer steps, written with
:func:`jaxcomm.optax.save_state` (Orbax; every rank's error-feedback residual shard included)
plus ``loop.json`` (the training loop's own counters). It is written under a temporary name,
``step_<N>.partial``, and renamed by process 0 once every process has written its shards and
``loop.json`` is on disk, so a directory called ``step_<N>`` is always complete: a process
killed in the middle of a write leaves only a ``.partial`` directory, which
:func:`latest` ignores and :func:`prune` removes.

Importing this module needs only the standard library (the launcher reads :func:`latest`
without starting JAX); :func:`save` and :func:`restore` import JAX and Orbax when called.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

_NAME = re.compile(r"^step_(\d{8})$")
LOOP_FILE = "loop.json"
KEEP = 2
"""Complete checkpoints :func:`prune` keeps (the newest ones)."""


def path_of(directory: str | os.PathLike, step: int) -> pathlib.Path:
    """Returns where the checkpoint after `step` optimizer steps lives.

    Args:
      directory: the checkpoint directory.
      step: optimizer steps done.

    Returns:
      ``directory/step_<8-digit step>``.

    Example:
      >>> path_of("/tmp/ck", 40).name
      'step_00000040'
    """
    return pathlib.Path(directory) / f"step_{step:08d}"


def complete(directory: str | os.PathLike) -> list[int]:
    """Returns the steps of the complete checkpoints in `directory`, oldest first.

    Args:
      directory: the checkpoint directory (it need not exist).

    Returns:
      Sorted step numbers; ``.partial`` (torn) checkpoints are not among them.

    Example:
      >>> complete("/nonexistent")
      []
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    steps = []
    for name in names:
        m = _NAME.match(name)
        if m and (pathlib.Path(directory) / name / LOOP_FILE).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest(directory: str | os.PathLike) -> int | None:
    """Returns the step of the newest complete checkpoint, None when there is none.

    Args:
      directory: the checkpoint directory.

    Returns:
      Optimizer steps done at that checkpoint, or None.

    Example:
      >>> latest("/nonexistent") is None
      True
    """
    steps = complete(directory)
    return steps[-1] if steps else None


def read_loop_state(directory: str | os.PathLike, step: int) -> dict[str, Any]:
    """Returns the ``loop.json`` of checkpoint `step` (the training loop's counters).

    Args:
      directory: the checkpoint directory.
      step: a step listed by :func:`complete`.

    Returns:
      The mapping written by :func:`save` as ``loop_state``.

    Example:
      >>> read_loop_state("/tmp/ck", latest("/tmp/ck"))["step"]  # doctest: +SKIP
      40
    """
    return json.loads((path_of(directory, step) / LOOP_FILE).read_text())


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(
    directory: str | os.PathLike,
    step: int,
    tree: Any,
    loop_state: dict[str, Any] | None = None,
    process_index: int | None = None,
) -> pathlib.Path:
    """Writes the checkpoint after `step` optimizer steps, atomically. Every process calls it.

    Orbax writes every process's shards into ``step_<N>.partial`` and meets the other
    processes; then process 0 writes ``loop.json``, fsyncs, renames the directory to
    ``step_<N>`` and removes older checkpoints beyond :data:`KEEP`.

    Args:
      directory: the checkpoint directory (created), on a filesystem every process shares.
      step: optimizer steps done.
      tree: the state, e.g. ``(params, opt_state)`` of global jax.Arrays.
      loop_state: JSON-serializable counters stored beside it (``step`` is added).
      process_index: this process's index (default ``jax.process_index()``).

    Returns:
      The final path (complete once process 0 has returned).

    Example:
      >>> save("/tmp/ck", 40, (params, opt_state), {"seconds": 1.5})  # doctest: +SKIP
    """
    import jax

    from jaxcomm.optax import save_state

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = path_of(directory, step)
    partial = final.with_name(final.name + ".partial")
    save_state(partial, tree)
    if (jax.process_index() if process_index is None else process_index) != 0:
        return final
    loop = {**(loop_state or {}), "step": step}
    tmp = partial / (LOOP_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(loop, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / LOOP_FILE)
    _fsync_dir(partial)
    if final.exists():  # a rerun of the same step after a restart: same content, replace it
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(directory)
    prune(directory)
    return final


def prune(directory: str | os.PathLike, keep: int = KEEP) -> None:
    """Removes torn (``.partial`` or Orbax temporary) checkpoints and all but the newest `keep`.

    Only process 0 calls it, while no other process writes (at a save, or before a resume).

    Args:
      directory: the checkpoint directory.
      keep: complete checkpoints kept.

    Returns:
      None.

    Example:
      >>> prune("/nonexistent")
    """
    directory = pathlib.Path(directory)
    kept = set(complete(directory)[-keep:])
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = _NAME.match(name)
        if m and int(m.group(1)) in kept:
            continue
        if name.startswith("step_"):  # older, or torn (.partial, Orbax's temporary names)
            shutil.rmtree(directory / name, ignore_errors=True)


def restore(directory: str | os.PathLike, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
    """Reads checkpoint `step` back with the shardings of `like`. Every process calls it.

    Args:
      directory: the checkpoint directory.
      step: a step listed by :func:`complete`.
      like: a tree shaped like the saved one (e.g. freshly initialized ``(params, state)``).

    Returns:
      ``(tree, loop_state)``: the restored tree, bit-identical to what was saved, and the
      ``loop.json`` counters.

    Example:
      >>> (params, state), loop = restore("/tmp/ck", latest("/tmp/ck"), (params, state))  # doctest: +SKIP
    """
    from jaxcomm.optax import restore_state

    path = path_of(directory, step)
    return restore_state(path, like), read_loop_state(directory, step)
