"""The library's registration table (ffi/registrations.h) as jaxcomm/_ffi.py reads it."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import _ffi

# Every target name the Python API calls; other code (the algorithm modules, the optax
# transforms) refers to these names, so they must not change.
EXPECTED_TARGETS = {
    "jaxcomm_topk_abs",
    "jaxcomm_topk_compress",
    "jaxcomm_topk_decompress",
    "jaxcomm_onebit_compress",
    "jaxcomm_onebit_decompress",
    "jaxcomm_threshold_compress",
    "jaxcomm_threshold_decompress",
    "jaxcomm_adaptive_compress",
    "jaxcomm_adaptive_decompress",
    "jaxcomm_blockquant_compress",
    "jaxcomm_blockquant_decompress",
    "jaxcomm_sparse_merge",
    "jaxcomm_allreduce",
    "jaxcomm_allreduce_bf16",
    "jaxcomm_allreduce_f16",
    "jaxcomm_topk_allgather",
    "jaxcomm_gtopk",
    "jaxcomm_quantized_allreduce",
    "jaxcomm_hierarchical_allreduce",
    "jaxcomm_hierarchical_quantized",
    "jaxcomm_blockquant_allreduce",
    "jaxcomm_hierarchical_blockquant",
    "jaxcomm_collective_done",
    "jaxcomm_handle_wait",
    "jaxcomm_mark",
}
# Targets without a CUDA handler: the 16-bit wire allreduces, the timeline mark and the wait of
# a detached collective (detached collectives run on CPU).
CPU_ONLY_TARGETS = {
    "jaxcomm_allreduce_bf16",
    "jaxcomm_allreduce_f16",
    "jaxcomm_mark",
    "jaxcomm_handle_wait",
}

# A handler definition: JAXCOMM_DEFINE_<kind>("target", impl, binding).
_DEFINITION = re.compile(r'JAXCOMM_DEFINE_(\w+)\(\s*"(\w+)",')


def cuda_definitions(repo_root) -> dict[str, str]:
    """target -> definition macro of every handler in ffi/cuda/ (compiled in CUDA builds only,
    so read from the sources)."""
    sources = "".join(p.read_text() for p in sorted((repo_root / "ffi" / "cuda").glob("*.cc")))
    return {target: kind for kind, target in _DEFINITION.findall(sources)}


def test_table_lists_every_target_once_with_a_cpu_handler():
    table = _ffi.registrations()
    assert set(table) == EXPECTED_TARGETS
    assert all(row.target == name for name, row in table.items())
    assert all(row.cpu for row in table.values())
    # Distinct handlers: no row points at another row's function.
    assert len({row.cpu for row in table.values()}) == len(table)


def test_only_the_c_functions_are_exported():
    """The handlers have no exported symbol (the table is the only way to them): the library
    exports exactly the plain C functions of _ffi.C_FUNCTIONS (the CUDA ones in CUDA builds)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    path = pathlib.Path(_ffi.__file__).with_name("libjaxcomm_ffi.so")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if " T " in line}
    cuda_only = {"jaxcomm_gpu_world_ordinals", "jaxcomm_nccl_set_library"}
    expected = set(_ffi.C_FUNCTIONS) - (set() if _ffi.has_gpu_kernels() else cuda_only)
    assert exported == expected


def test_cuda_column_matches_the_build(repo_root):
    """A CUDA build has a CUDA handler for every target ffi/cuda/ defines (all but the CPU-only
    ones); a CPU build has none, and then nothing is split on a GPU."""
    defined = cuda_definitions(repo_root)
    assert set(defined) == EXPECTED_TARGETS - CPU_ONLY_TARGETS
    table = _ffi.registrations()
    with_cuda = {t for t, row in table.items() if row.cuda is not None}
    assert with_cuda == (set(defined) if _ffi.has_gpu_kernels() else set())
    assert with_cuda >= _ffi.GPU_SPLIT_TARGETS


def test_gpu_split_targets_come_from_the_splittable_definitions(repo_root):
    """_ffi.GPU_SPLIT_TARGETS (Python emits start/done for them on GPU) are the rows that
    JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE registered (the other CUDA collectives refuse
    `split` at run time, which CI without a GPU would never see)."""
    splittable = {
        t for t, kind in cuda_definitions(repo_root).items() if kind.endswith("SPLITTABLE")
    }
    assert splittable == {"jaxcomm_allreduce"}, "did the macro's name change?"
    flagged = {t for t, row in _ffi.registrations().items() if row.gpu_split}
    assert _ffi.GPU_SPLIT_TARGETS == flagged
    assert flagged == (splittable if _ffi.has_gpu_kernels() else set())


def test_registered_targets_run():
    """A target registered from the table runs under its name (the top-k magnitude op)."""
    x = np.array([0.5, -3.0, 2.0, -0.1], np.float32)
    values, indices = jax.ffi.ffi_call(
        "jaxcomm_topk_abs",
        (jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)),
    )(jnp.asarray(x))
    indices = np.asarray(indices)
    assert sorted(indices.tolist()) == [1, 2]
    np.testing.assert_array_equal(np.asarray(values), x[indices])
