"""A launched rank keeps the host memory it frees (jaxcomm_launcher.hostmem)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from jaxcomm_launcher.hostmem import GLIBC_MALLOC_VARIABLES, keep_freed_memory

from jaxcomm.config import ConfigError

# Allocates, fills and frees a buffer four times, in the main thread (48 MiB: above any mmap
# threshold glibc picks by itself) and in a new thread (96 MiB: above a thread heap's 64 MiB),
# and prints the page faults each round took.
_ROUNDS = """
import ctypes, json, os, resource, threading
from jaxcomm_launcher.hostmem import keep_freed_memory

kept = keep_freed_memory(os.environ)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = {}

def rounds(size):
    faults[size] = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buf = libc.malloc(size)
        ctypes.memset(buf, 1, size)
        libc.free(buf)
        faults[size].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

rounds(48 << 20)
thread = threading.Thread(target=rounds, args=(96 << 20,))
thread.start()
thread.join()
print(json.dumps({"kept": kept, "faults": list(faults.values())}))
"""


def _rounds(setting: str) -> dict:
    env = {**os.environ, "JAXCOMM_HOST_MALLOC": setting, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in (*GLIBC_MALLOC_VARIABLES, "GLIBC_TUNABLES"):  # else the setting stands aside
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize("where", [0, 1], ids=["main thread", "new thread"])
def test_a_kept_buffer_is_faulted_in_once(where):
    system = _rounds("system")["faults"][where]
    keep = _rounds("keep")
    pages = ((48, 96)[where] << 20) // os.sysconf("SC_PAGE_SIZE")
    # glibc unmaps the buffer at every free: each round faults every page in again.
    assert all(f >= pages // 2 for f in system), system
    # Kept: the first round faults the pages in, the others reuse them.
    assert keep["kept"]
    faults = keep["faults"][where]
    assert faults[0] >= pages // 10 and all(f < pages // 20 for f in faults[1:]), faults


def test_the_users_own_malloc_settings_win():
    assert not keep_freed_memory({"JAXCOMM_HOST_MALLOC": "system"})
    assert not keep_freed_memory({"MALLOC_ARENA_MAX": "2"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})


def test_a_bad_setting_names_itself():
    with pytest.raises(ConfigError, match="JAXCOMM_HOST_MALLOC"):
        keep_freed_memory({"JAXCOMM_HOST_MALLOC": "never"})
