"""The C heap policy of runs on a CPU device (executor/tiers/host_heap.py), in fresh processes: mallopt's
settings are process-wide and cannot be read back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierflow.executor.tiers.host_heap import glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="the policy is glibc's (mallopt)")

# a block of 24 MiB taken from the C heap, written and freed, the minor page faults of each such cycle (the
# block is the heap's top: nothing else is allocated between): glibc trimming its heap at a threshold below
# the block (fixed here at its 128 KiB start; its adaptive threshold left a step of the 6 x 384 model above
# it), then with the policy
CYCLES = """
import ctypes, json, resource
from tierflow.executor.tiers import host_heap

libc = host_heap.glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
N = 24 << 20

def cycle():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(N)
    ctypes.memset(p, 1, N)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

libc.mallopt(host_heap.M_MMAP_THRESHOLD, host_heap.MMAP_THRESHOLD_BYTES)
libc.mallopt(host_heap.M_TRIM_THRESHOLD, 128 * 1024)
trimming = [cycle() for _ in range(4)]
kept = host_heap.keep_freed_heap()
print(json.dumps({"trimming": trimming, "kept": kept, "policy": [cycle() for _ in range(4)]}))
"""

EXECUTOR = """
import json
from tierflow.executor.calibration.dispatch import _executor, tiny_plan
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.tiers import host_heap

before = host_heap.heap_kept()
_executor(tiny_plan("cpu"), PlainCpuBackend(), None)
print(json.dumps({"before": before, "after": host_heap.heap_kept()}))
"""


def _run(script: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_heap_is_kept_instead_of_faulted_back():
    got = _run(CYCLES)
    assert got["kept"] is True
    # trimmed: each cycle takes its 24 MiB back page by page (6,144 pages of 4 KiB; fewer with huge pages)
    assert min(got["trimming"][1:]) > 500, got
    # kept: from the second cycle on the freed block is found in the heap
    assert max(got["policy"][1:]) < min(got["trimming"][1:]) / 10, got


def test_an_executor_on_the_cpu_sets_the_policy():
    got = _run(EXECUTOR)
    assert got == {"before": False, "after": True}
