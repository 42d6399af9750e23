"""Test helpers: deterministic tensors and daemons in separate processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

DAEMON_SCRIPT = r"""
import sys, torch, weightcache
sys.path.insert(0, {tests!r})
from procs import sample_tensors
from weightcache.key import CacheKey
device = {device!r}
if device.startswith("cuda"):
    torch.cuda.set_device(0)
d = weightcache.publish(sample_tensors(device, {scale!r}), {sock!r}, CacheKey(model="sample", content_digest="d0"),
                        **{kwargs!r})
d.install_signal_handlers()
print("READY", flush=True)
d.serve_forever()
"""


def sample_tensors(device: str = "cpu", scale: int = 1) -> dict[str, torch.Tensor]:
    """Deterministic tensors covering dtypes, odd shapes/strides, ties and views."""
    g = torch.Generator().manual_seed(1234)
    emb = torch.randn(97 * scale, 33, generator=g).to(device)
    base = torch.randn(40, 24, generator=g).to(device)
    out = {
        "embed": emb,
        "lm_head": emb,  # tied
        "w_t": torch.randn(31, 17, generator=g).t(),  # non-contiguous
        "slice_a": base[:, :12],  # two views of one storage
        "slice_b": base[5:, 12:],
        "bias": torch.randn(17, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, 7, generator=g).half(),
        "f64": torch.randn(11, generator=g).double(),
        "fp8_e4m3": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(8, 3, generator=g).to(torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9, 2), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (6,), generator=g, dtype=torch.int32),
        "i64": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
    }
    return {k: v.to(device) for k, v in out.items()}  # no-op for the shared ones: ties and views survive


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, comparable with torch.equal for every dtype (NaNs and fp8 included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def start_daemon(sock: str, device: str = "cpu", scale: int = 1, timeout: float = 120.0, *, nofile: int | None = None,
                 stderr=None, **daemon_kwargs) -> subprocess.Popen:
    """A daemon process serving sample_tensors(device, scale) at `sock`; `nofile` caps its descriptors."""
    code = DAEMON_SCRIPT.format(tests=os.path.dirname(__file__), device=device, sock=sock, scale=scale,
                                kwargs=daemon_kwargs)

    def limit_fds():
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            preexec_fn=limit_fds)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"daemon did not start (rc={proc.wait()}): {line!r}")
    assert time.monotonic() < deadline
    return proc
