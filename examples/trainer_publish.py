"""A trainer publishes versioned weights; an inference process attaches each new version.

    python examples/trainer_publish.py --versions 3 --steps-per-version 20 [--device cuda]

The trainer (this process) runs training steps and, every ``--steps-per-version`` steps, publishes a
snapshot with ``weightcache.publish`` under a versioned key (revision ``v<N>``; its own socket). It tells
the inference process about each version over a pipe (a real deployment uses its own control channel).
The inference process (the same script, ``--role inference``) builds the model on the meta device and
binds the new version with ``load_into``; it keeps the previous version until it has switched. The
trainer retires versions older than ``--keep``: their daemons close, yet an engine still holding such a
version keeps computing correct results until it drops it (the memory is refcounted by the kernel/driver).
See docs/publishing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import torch
from torch import nn

import weightcache as wc
from weightcache.dtypes import dtype_name
from weightcache.integrations.torch import load_into
from weightcache.key import CacheKey
from weightcache.sockets import device_tag, ensure_private_dir, socket_path

VOCAB, DIM = 64, 32


class ToyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + self.mlp(x))


def probe(device) -> torch.Tensor:
    return torch.arange(0, VOCAB, 5, device=device)[None]


def version_key(run_id: str, version: int, step: int, dtype: torch.dtype) -> CacheKey:
    # one identity per snapshot: the run and the step say what the bytes are without hashing them
    return CacheKey(model="toy-lm", content_digest=f"{run_id}:step-{step}", revision=f"v{version}",
                    dtype=dtype_name(dtype), engine="torch", extra={"run": run_id})


def send(pipe, msg: dict) -> None:
    pipe.write(json.dumps(msg) + "\n")
    pipe.flush()


def trainer(args) -> int:
    device = torch.device(args.device)
    own_dir = args.socket_dir is None
    sock_dir = ensure_private_dir(args.socket_dir or tempfile.mkdtemp(prefix="wc-train-"))
    run_id = uuid.uuid4().hex[:8]
    torch.manual_seed(0)
    model = ToyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "inference", "--device", args.device],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    published: dict[int, wc.Daemon] = {}
    step = 0
    try:
        for version in range(1, args.versions + 1):
            for _ in range(args.steps_per_version):  # learn "next token = token + 1"
                ids = torch.randint(0, VOCAB - 1, (16, 8), device=device)
                loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), (ids + 1).flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
            key = version_key(run_id, version, step, torch.float32)
            sock = socket_path(sock_dir, key, device_tag(device))
            t0 = time.perf_counter()
            with torch.no_grad():
                published[version] = wc.publish(dict(model.state_dict()), sock, key)  # a snapshot (copied)
                expected = model(probe(device)).cpu()
            print(f"trainer: step {step} loss {loss.item():.3f}: published v{version} at {sock.name} "
                  f"in {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
            send(child.stdin, {"version": version, "socket": str(sock), "key": json.loads(_key_json(key)),
                               "expected": expected.tolist()})
            reply = child.stdout.readline().strip()
            print(reply, flush=True)
            if not reply.startswith(f"inference: attached v{version}"):
                raise RuntimeError(f"inference process did not take v{version}: {reply!r}")
            for old in [v for v in published if v <= version - args.keep]:
                published.pop(old).close()  # retire: no new attaches; held views stay valid
                send(child.stdin, {"retired": old})
                print(child.stdout.readline().strip(), flush=True)
        send(child.stdin, {"stop": True})
        return child.wait(timeout=60)
    finally:
        for d in published.values():
            d.close()
        if child.poll() is None:
            child.kill()
            child.wait()
        if own_dir:
            shutil.rmtree(sock_dir, ignore_errors=True)


def _key_json(key: CacheKey) -> str:
    import msgspec

    return msgspec.json.encode(key).decode()


def inference(args) -> int:
    import msgspec

    device = torch.device(args.device)
    held: dict[int, tuple[nn.Module, torch.Tensor]] = {}  # version -> (model, its expected output)
    current = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("stop"):
            break
        if "retired" in msg:
            old = msg["retired"]
            model, expected = held.pop(old)
            with torch.no_grad():  # the daemon of this version is gone; our mapping is not
                ok = torch.allclose(model(probe(device)).cpu(), expected, rtol=1e-5, atol=1e-6)
            model._weightcache_attachment.close()
            state = "still correct" if ok else "WRONG"
            print(f"inference: old version v{old} {state} after its daemon closed; released", flush=True)
            continue
        key = msgspec.json.decode(json.dumps(msg["key"]).encode(), type=CacheKey)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = ToyLM()
        load_into(model, msg["socket"], expect=key)  # checks the key: never a wrong version
        ms = 1e3 * (time.perf_counter() - t0)
        expected = torch.tensor(msg["expected"])
        with torch.no_grad():
            ok = torch.allclose(model(probe(device)).cpu(), expected, rtol=1e-5, atol=1e-6)
        held[msg["version"]] = (model, expected)
        current = msg["version"]  # new requests go to the new version from here on
        print(f"inference: attached v{current} in {ms:.1f} ms, outputs {'match' if ok else 'DIFFER'}"
              f" (holding {sorted(held)})", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--steps-per-version", type=int, default=20)
    p.add_argument("--keep", type=int, default=1, help="versions the trainer keeps serving")
    p.add_argument("--device", default="cpu")
    p.add_argument("--socket-dir", default=None)
    p.add_argument("--role", choices=["trainer", "inference"], default="trainer")
    args = p.parse_args(argv)
    if args.versions < 1 or args.steps_per_version < 1 or args.keep < 1:
        p.error("--versions, --steps-per-version and --keep must be at least 1")
    return trainer(args) if args.role == "trainer" else inference(args)


if __name__ == "__main__":
    sys.exit(main())
