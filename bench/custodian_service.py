"""The custodian as a service: how fast it answers while clients misbehave, and what it costs in memory.

Side by side, on one custodian process:
  quiet     ListHoldings round trips with no one else connected
  stalled   the same while K clients have each claimed a large cache (4 MiB answer) and never read it
and its resident memory idle and holding N caches. The ratio stalled / quiet is what matters (1.0: no one is
held up); absolute times depend on the machine.

    python bench/custodian_service.py --rounds 300 --stalled 8 --caches 64

Writes bench/results/custodian-service.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))

import msgspec  # noqa: E402

from weightcache import wire  # noqa: E402
from weightcache.custodian.client import CustodianClient, launch  # noqa: E402
from weightcache.custodian.messages import Claim, Hello, Holding, _decoder  # noqa: E402
from weightcache.handover import use_credential  # noqa: E402
from weightcache.key import CacheKey  # noqa: E402
from weightcache.manifest import BlockSpec, Manifest  # noqa: E402
from weightcache.sockets import custodian_socket_path, socket_name  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def deposit(client: CustodianClient, token: str, key: CacheKey) -> str:
    import fcntl

    fd = os.memfd_create("weightcache-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    name = socket_name(key, "cpu")
    h = Holding(name=name, model=key.model, role=key.role, rank=key.rank, device="cpu", block_bytes=[4096])
    manifest = Manifest(tensors=[], storages=[], blocks=[BlockSpec(4096)])
    client.deposit(h, msgspec.msgpack.encode(key), msgspec.msgpack.encode(manifest), [fd], token)
    os.close(fd)
    return name


def round_trips(sdir: str, rounds: int) -> list[float]:
    c = CustodianClient.connect(sdir)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        c.holdings()
        out.append(time.perf_counter() - t0)
    c.close()
    return out


def stall(sdir: str, name: str, token: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(custodian_socket_path(sdir)))
    wire.send_msg(s, Hello(protocol=2))
    wire.recv_msg(s, deadline=time.monotonic() + 5, decoder=_decoder)
    wire.send_msg(s, Claim(name=name, token=token))
    return s


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--stalled", type=int, default=8)
    p.add_argument("--caches", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "custodian-service.json"))
    a = p.parse_args(argv)
    sdir = tempfile.mkdtemp(prefix="wcs", dir="/tmp")
    os.chmod(sdir, 0o700)
    launch(sdir)
    owner = CustodianClient.connect(sdir)
    token = secrets.token_hex(32)
    owner.register(token, 600.0)
    use_credential(custodian_socket_path(sdir), token)
    try:
        idle = rss_mib(owner.pid)
        big = deposit(owner, token, CacheKey(model="bench", content_digest="x", rank=0,
                                             extra={"pad": "x" * (4 << 20)}))
        for r in range(1, a.caches):
            deposit(owner, token, CacheKey(model="bench", content_digest="x", rank=r))
        holding = rss_mib(owner.pid)
        quiet = round_trips(sdir, a.rounds)
        stalled_socks = [stall(sdir, big, token) for _ in range(a.stalled)]
        time.sleep(0.2)
        stalled = round_trips(sdir, a.rounds)
        for s in stalled_socks:
            s.close()
    finally:
        owner.stop()
        owner.close()
        shutil.rmtree(sdir, ignore_errors=True)
    row = {"rounds": a.rounds, "stalled_clients": a.stalled, "caches": a.caches,
           "quiet_p50_ms": statistics.median(quiet) * 1e3, "quiet_p99_ms": p99(quiet) * 1e3,
           "stalled_p50_ms": statistics.median(stalled) * 1e3, "stalled_p99_ms": p99(stalled) * 1e3,
           "rss_idle_mib": idle, "rss_holding_mib": holding}
    row["stalled_vs_quiet_p50"] = row["stalled_p50_ms"] / row["quiet_p50_ms"]
    meta = {"host": socket.gethostname(), "cpu": platform.processor(), "date": time.strftime("%Y-%m-%d"),
            "command": "python bench/custodian_service.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": [row]}, indent=1))
    print("| list round trip | p50 | p99 |\n| --- | --- | --- |")
    print(f"| quiet | {row['quiet_p50_ms']:.2f} ms | {row['quiet_p99_ms']:.2f} ms |")
    print(f"| {a.stalled} clients stalled on a 4 MiB answer | {row['stalled_p50_ms']:.2f} ms | "
          f"{row['stalled_p99_ms']:.2f} ms |")
    print(f"\nstalled / quiet (p50): {row['stalled_vs_quiet_p50']:.2f}x; custodian RSS {idle:.1f} MiB idle, "
          f"{holding:.1f} MiB holding {a.caches} caches\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
