"""Checkpoints of the training state: a tree saved and restored bit-exact, and atomic, numbered
checkpoints in one directory (what a restarted run resumes from).

:func:`save_state` and :func:`restore_state` (also ``jaxcomm.optax.save_state`` and
``jaxcomm.optax.restore_state``) write and read a tree of sharded jax.Arrays with Orbax, every
rank's error-feedback residual shard included.

A numbered checkpoint is ``<dir>/step_<N>``: the state after ``N`` optimizer steps, written with
:func:`save_state` plus ``loop.json`` (the training loop's own counters). It is written under a
temporary name, ``step_<N>.partial``, and renamed by process 0 once every process has written
its shards and ``loop.json`` is on disk, so a directory called ``step_<N>`` is always complete:
a process killed in the middle of a write leaves only a ``.partial`` directory, which
:func:`latest` ignores and :func:`prune` removes.

Importing this module needs only the standard library (the launcher reads :func:`latest`
without starting JAX); the functions that read or write arrays import JAX and Orbax when
called.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import warnings
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
    path = path_of(directory, step)
    return restore_state(path, like), read_loop_state(directory, step)


def _checkpointer() -> Any:
    """Orbax's standard checkpointer, or an ImportError naming the extra that provides it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "jaxcomm.optax.save_state/restore_state use Orbax: python -m pip install "
            "'jaxcomm[checkpoint]' (or orbax-checkpoint)"
        ) from e
    return ocp.StandardCheckpointer()


def save_state(path: str | os.PathLike, tree: Any) -> None:
    """Saves a tree of (possibly sharded) jax.Arrays with Orbax, every shard bit-exact.

    Each rank's error-feedback residual is a shard of an array sharded over the data-parallel
    axis (:func:`jaxcomm.optax.partition_specs`), so it is saved as it is, and :func:`restore_state` gives
    every rank back its own residual: training resumes bit for bit where it stopped (the
    residuals are not reset on load, unlike DeepSpeed's 1-bit Adam). Every process must call
    it (Orbax writes its addressable shards and meets the others); it returns once the
    checkpoint is on disk.

    Args:
      path: the checkpoint directory (replaced if it exists).
      tree: a pytree of jax.Arrays (e.g. ``(params, opt_state)``).

    Returns:
      None.

    Raises:
      ImportError: Orbax is not installed (the ``checkpoint`` extra).

    Example:
      >>> import tempfile
      >>> save_state(tempfile.mkdtemp() + "/step100", params)
    """
    checkpointer = _checkpointer()
    checkpointer.save(os.path.abspath(path), tree, force=True)
    checkpointer.wait_until_finished()


def restore_state(path: str | os.PathLike, like: Any) -> Any:
    """Restores what :func:`save_state` wrote, with the shardings of ``like``.

    Args:
      path: the directory given to ``save_state``.
      like: a tree of the same structure whose leaves have ``.shape``, ``.dtype`` and
        ``.sharding`` (e.g. the freshly initialized state, or ``jax.ShapeDtypeStruct``).

    A checkpoint saved by another number of ranks restores too: each per-rank leaf
    (``P(axis_name)``: residuals, DiLoCo's own parameters and inner state) starts on every
    rank from the mean of the saved ranks' values (integers: the first rank's), with one
    warning naming them (:mod:`jaxcomm.resharding`).

    Returns:
      The restored tree of jax.Arrays, bit-identical to what was saved (but the per-rank
      leaves of a checkpoint from another world size).

    Raises:
      ValueError: a leaf of ``like`` whose dtype differs from the saved one (Orbax would cast
        it), whose shape differs other than by the number of ranks, or that the checkpoint
        lacks.
      ImportError: Orbax is not installed (the ``checkpoint`` extra).

    Example:
      >>> import tempfile
      >>> path = tempfile.mkdtemp() + "/step100"
      >>> save_state(path, params)
      >>> restored = restore_state(path, params)
      >>> bool((restored["layer0"]["w"] == params["layer0"]["w"]).all())
      True
    """
    import jax
    import numpy as np

    from jaxcomm import resharding

    checkpointer = _checkpointer()
    path = os.path.abspath(path)
    metadata = checkpointer.metadata(path)
    saved = {m.name: m for m in jax.tree.leaves(getattr(metadata, "item_metadata", metadata))}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = [".".join(_key_name(k) for k in keys) for keys, _ in flat]
    abstract, changed = [], {}
    for name, (_, leaf) in zip(names, flat, strict=True):
        if name not in saved:
            raise ValueError(f"restore_state: {path} has no leaf {name!r}; saved: {sorted(saved)}")
        m = saved[name]
        how = None
        if np.dtype(m.dtype) == np.dtype(leaf.dtype) and tuple(m.shape) != tuple(leaf.shape):
            how = resharding.plan(m.shape, m.dtype, leaf)  # another world size?
        if np.dtype(m.dtype) != np.dtype(leaf.dtype) or (
            tuple(m.shape) != tuple(leaf.shape) and how is None
        ):
            raise ValueError(
                f"restore_state: leaf {name!r} was saved as {np.dtype(m.dtype)}{list(m.shape)}, "
                f"`like` has {np.dtype(leaf.dtype)}{list(leaf.shape)}"
            )
        if how is None:
            abstract.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding))
        else:
            abstract.append(resharding.replicated(leaf, m.shape, m.dtype))
            changed[name] = (how, *resharding.world_sizes(m.shape, leaf))
    restored = checkpointer.restore(path, treedef.unflatten(abstract))
    if not changed:
        return restored
    warnings.warn(resharding.warning(path, changed), stacklevel=2)
    out = [
        resharding.convert(x, leaf, changed[name][0]) if name in changed else x
        for name, (_, leaf), x in zip(names, flat, treedef.flatten_up_to(restored), strict=True)
    ]
    return treedef.unflatten(out)


def _key_name(key: Any) -> str:
    """One part of a leaf's name in Orbax's metadata (``1.0.count``)."""
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
