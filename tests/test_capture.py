"""Packing that consumes its sources (`load_tensors(consume=True)` / `publish(consume=True)`): the engine's
freshly built weights move into the arena block by block, so a daemon holds ~1x a rank's weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

import weightcache as wc
from conftest import DEVICES
from procs import bits, sample_tensors
from weightcache.key import CacheKey
from weightcache.manifest import capture_block_bytes
from weightcache.packing import plan_for_tensors, release_storage

KEY = CacheKey(model="sample", content_digest="d0")
HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("device", DEVICES)
def test_consumed_sources_are_freed_and_served_bit_identical(sockdir, device):
    expected = sample_tensors(device)  # deterministic: the same tensors again
    src = sample_tensors(device)
    sock = os.path.join(sockdir, "r0.sock")
    with wc.publish(src, sock, KEY, consume=True, block_bytes=4096):
        assert all(t.untyped_storage().nbytes() == 0 for t in src.values())
        with wc.attach(sock, expect=KEY) as att:
            assert len(att.manifest.blocks) > 1  # small blocks: filled and freed one after another
            for name, t in expected.items():
                v = att[name]
                assert (v.dtype, v.shape, v.stride()) == (t.dtype, t.shape, t.stride()), name
                assert torch.equal(bits(v), bits(t)), name
            assert att["embed"].data_ptr() == att["lm_head"].data_ptr()
            assert att["slice_a"].untyped_storage().data_ptr() == att["slice_b"].untyped_storage().data_ptr()


def test_block_size_for_consuming_is_a_sixteenth_within_bounds():
    assert capture_block_bytes(160 << 30) == 10 << 30
    assert capture_block_bytes(1 << 40) == 16 << 30  # never above the arena's block size
    assert capture_block_bytes(1 << 20) == 256 << 20  # tiny models: one modest block
    assert capture_block_bytes(1 << 20, block_bytes=4096) == 4096
    tensors = {f"w{i}": torch.zeros(1 << 18) for i in range(32)}  # 32 MiB in 1 MiB storages
    manifest, _ = plan_for_tensors(tensors, consume=True, block_bytes=4 << 20)
    assert len(manifest.blocks) == 8 and max(b.nbytes for b in manifest.blocks) <= 4 << 20


def test_release_storage_reports_what_it_cannot_free():
    t = torch.ones(1024)
    assert release_storage(t) == 0 and t.untyped_storage().nbytes() == 0
    foreign = torch.frombuffer(bytearray(4096), dtype=torch.uint8)  # memory torch does not own
    assert release_storage(foreign) == 4096 and foreign.untyped_storage().nbytes() == 4096


PEAK = r"""
import json, os, sys, torch
sys.path.insert(0, {here!r})
import weightcache as wc
from weightcache.key import CacheKey

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

tensors = {{f"layer{{i}}": torch.randn(1 << 22) for i in range(24)}}  # 24 x 16 MiB
base = hwm()
d = wc.publish(tensors, {sock!r}, CacheKey(model="m", content_digest="d"), consume={consume}, block_bytes=32 << 20)
print(json.dumps({{"weights": 24 * (16 << 20), "added": hwm() - base}}))
d.close()
"""


@pytest.mark.parametrize("consume", [True, False])
def test_peak_memory_of_packing(sockdir, consume):
    """Consuming: peak ~1x weights + one block; copying: ~2x (the reason consuming exists)."""
    code = PEAK.format(here=HERE, sock=os.path.join(sockdir, "p.sock"), consume=consume)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if consume:
        assert r["added"] <= (32 << 20) + (24 << 20), r  # one block in flight, plus slack
    else:
        assert r["added"] >= 0.9 * r["weights"], r


@pytest.mark.gpu
@pytest.mark.parametrize("consume", [True, False])
def test_peak_device_memory_of_packing(sockdir, consume):
    """On CUDA the daemon samples its device memory while packing: ~1x + one block when consuming."""
    tensors = {f"layer{i}": torch.randn(1 << 26, device="cuda") for i in range(16)}  # 16 x 256 MiB
    weights = 16 * (256 << 20)
    torch.cuda.synchronize()
    d = wc.Daemon(os.path.join(sockdir, "g.sock"), KEY, device="cuda", block_bytes=1 << 30)  # baseline: tensors in use
    d.start()
    try:
        d.load_tensors(tensors, consume=consume)
        peak = d.status().peak_device_bytes
        if consume:
            assert peak <= 512 << 20, peak  # one 256 MiB block (4 GiB / 16) beyond what was in use, plus slack
        else:
            assert peak >= 0.9 * weights, peak
    finally:
        d.close()


def test_load_time_counts_from_when_the_engine_began_building(sockdir):
    """A source passes when its engine's loader began: the reported load time and rate cover the whole build
    (reading, quantizing, post-processing), not only the packing that follows it."""
    import time

    from weightcache.daemon import Daemon

    tensors = {"w": torch.ones(1 << 16)}
    d = Daemon(os.path.join(sockdir, "r0.sock"), KEY)
    d.start()
    try:
        d.load_tensors(tensors, consume=True, began=time.monotonic() - 2.0)
        st = wc.query_status(os.path.join(sockdir, "r0.sock"))
        assert st.state == "ready" and 2.0 <= st.load_seconds < 30
        assert st.load_bytes_per_second == pytest.approx(st.nbytes / st.load_seconds, rel=0.05)
    finally:
        d.close()
