"""The write-fault line comes out whichever thread faults, and however many fault at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

RACE = r"""
import ctypes, mmap, threading, time, warnings
import torch
from weightcache import faults

mm = mmap.mmap(-1, 1 << 20, prot=mmap.PROT_READ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    addr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
second_may_fault = threading.Event()

def describe(a):
    second_may_fault.set()
    time.sleep(0.5)  # the other thread faults while this line is being made
    return f"weightcache: write to read-only weights at offset {a - addr}"

faults.register(addr, addr + (1 << 20), describe)

def second():
    second_may_fault.wait()
    ctypes.memset(addr + 8192, 1, 1)

threading.Thread(target=second, daemon=True).start()
print("WRITING", flush=True)
ctypes.memset(addr, 1, 1)
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_second_thread_faulting_meanwhile_does_not_cut_the_line(faulthandler):
    env = {**os.environ, "PYTHONFAULTHANDLER": "1" if faulthandler else ""}
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, env=env)
    assert "WRITING" in proc.stdout and "SURVIVED" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV
    lines = [x for x in proc.stderr.splitlines() if x.startswith("weightcache: write to read-only")]
    assert lines == ["weightcache: write to read-only weights at offset 0"], proc.stderr
    if faulthandler:
        assert "Fatal Python error" in proc.stderr.split(lines[0])[1]  # faulthandler still reports, after it
