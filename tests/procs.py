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


HELD_DAEMON_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from procs import sample_tensors
from weightcache.daemon import Daemon
from weightcache.handover import use_credential
from weightcache.key import CacheKey
device = {device!r}
if device.startswith("cuda"):
    torch.cuda.set_device(0)
use_credential({custodian!r}, sys.stdin.readline().strip())
d = Daemon({sock!r}, CacheKey(model="sample", content_digest={digest!r}), device=device, custodian={custodian!r})
d.start()
if d.adopt():
    how = "ADOPTED"
else:
    tensors = sample_tensors(device)
    if {big_mb!r}:
        tensors["big"] = torch.arange({big_mb!r} << 18, dtype=torch.int32, device=device)
    d.load_tensors(tensors)
    how = "LOADED"
d.install_signal_handlers()
print("READY", how, flush=True)
d.serve_forever()
"""


def start_held_daemon(sock: str, custodian: str, device: str = "cpu", digest: str = "d0",
                      big_mb: int = 0, token: str = "") -> tuple[subprocess.Popen, str]:
    """A daemon process that takes its cache from the custodian, or loads sample tensors (plus `big_mb` MiB)
    and deposits them; returns it and "ADOPTED" or "LOADED". `token`: the credential of the preload it
    belongs to (its caller registered it), given on its stdin."""
    code = HELD_DAEMON_SCRIPT.format(tests=os.path.dirname(__file__), device=device, sock=sock,
                                     custodian=custodian, digest=digest, big_mb=big_mb)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(token + "\n")
    proc.stdin.close()
    line = proc.stdout.readline().split()
    if line[:1] != ["READY"]:
        proc.kill()
        raise RuntimeError(f"daemon did not start (rc={proc.wait()}): {line!r}")
    return proc, line[1]


def memfd_inodes(pids=None) -> set[int]:
    """Inodes of weightcache memfds that processes (default: all we can see) hold open or map."""
    out: set[int] = set()
    for pid in pids if pids is not None else [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:weightcache"):
                        out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/memfd:weightcache"):
                        out.add(int(parts[4]))
        except OSError:
            continue
    return out


def block_digests(sock: str) -> list[str]:
    """sha256 of every block a daemon serves, read through its own handshake (what any client maps)."""
    import hashlib
    import mmap
    import socket as socketlib

    from weightcache import wire
    from weightcache.arena import import_blocks
    from weightcache.client import _device_for

    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock)
    try:
        wire.send_msg(s, wire.Hello(protocol=wire.PROTOCOL_VERSION))
        reply = wire.recv_msg(s)
        assert isinstance(reply, wire.Attached), reply
        fds = wire.recv_fds(s, reply.nfds)
        sizes = [b.nbytes for b in reply.manifest.blocks]
        if reply.manifest.device == "cpu":
            out = []
            for fd, n in zip(fds, sizes, strict=True):
                with mmap.mmap(fd, n, prot=mmap.PROT_READ) as mm:
                    out.append(hashlib.sha256(mm).hexdigest())
                os.close(fd)
            return out
        blocks = import_blocks(fds, sizes, _device_for(reply.manifest), readonly=True)
        return [hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest() for b in blocks]
    finally:
        s.close()
