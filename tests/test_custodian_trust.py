"""No other process can poison what the custodian hands a replacement daemon: a deposit or claim must carry a
running preload's credential and come from a process of that preload; a name is its key's; every memfd is
sealed against writes, shrinking and growing and is as large as its block; the adopting daemon checks every
block again. Each refusal is one log line naming what and why."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import msgspec
import pytest
import torch

from procs import block_digests, start_held_daemon
from test_custodian import (
    KEY,
    NAME,
    _sock,
    custodian_log,
    held_daemon,
    one_block,
    register,
    registered_custodian,
    sealed_memfd,
    wait_for,
)
from weightcache.custodian.client import CustodianClient
from weightcache.custodian.messages import CustodianError
from weightcache.daemon import Daemon

# A same-uid process outside the preload (its parent exits at once: it descends from no preload), holding
# what it would have learnt from a claim before claims were checked: the key and manifest of NAME.
OUTSIDER = r"""
import fcntl, json, os, sys
if os.fork() > 0:
    os._exit(0)
os.setsid()
sockdir, facts, out = sys.argv[1:4]
with open(facts) as f:
    facts = json.load(f)
from weightcache.custodian.client import CustodianClient
from weightcache.custodian.messages import Holding
said = {}
c = CustodianClient.connect(sockdir)
for label, token in (("claim", ""), ("claim_stolen", facts["token"])):
    try:
        c.claim(facts["name"], token)
        said[label] = "GOT IT"
    except Exception as e:
        said[label] = str(e)
h = Holding(name=facts["name"], model="sample", role="main", rank=0, device="cpu", block_bytes=facts["blocks"])
for label, token, sealed in (("unsealed", "", False), ("unsealed_stolen", facts["token"], False),
                             ("sealed_stolen", facts["token"], True)):
    fds = []
    for n in facts["blocks"]:
        fd = os.memfd_create("weightcache-poison", os.MFD_ALLOW_SEALING)
        os.write(fd, b"\x7f" * min(n, 4096))
        os.ftruncate(fd, n)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        fds.append(fd)
    try:
        c.deposit(h, bytes.fromhex(facts["key"]), bytes.fromhex(facts["manifest"]), fds, token)
        said[label] = "HELD"
    except Exception as e:
        said[label] = str(e)
with open(out + ".tmp", "w") as f:
    json.dump(said, f)
os.rename(out + ".tmp", out)
"""


@pytest.fixture
def custodian(sockdir):
    yield from registered_custodian(sockdir)


def test_a_process_outside_the_preload_can_neither_claim_nor_poison(sockdir, custodian, tmp_path):
    """The issue's attack: claim the cache, then deposit an unsealed memfd under its name for the next
    replacement daemon. Refused at every step, even with the preload's credential (not its process)."""
    first, how = start_held_daemon(_sock(sockdir), str(custodian.path), token=custodian.token)
    assert how == "LOADED"
    served = block_digests(_sock(sockdir))
    (held,) = custodian.holdings().holdings
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"name": NAME, "token": custodian.token, "blocks": held.block_bytes,
                                 "key": msgspec.msgpack.encode(KEY).hex(),
                                 "manifest": _manifest_for(held.block_bytes).hex()}))
    out = tmp_path / "said.json"
    before = custodian_log(sockdir).count("\n")
    subprocess.run([sys.executable, "-c", OUTSIDER, str(sockdir), str(facts), str(out)], check=True, timeout=60)
    wait_for(out.exists, 30, "the outsider to finish")
    said = json.loads(out.read_text())
    assert "no credential of a running preload" in said["claim"], said
    assert "is not a process of the preload" in said["claim_stolen"], said
    assert "no credential of a running preload" in said["unsealed"], said
    assert "is not a process of the preload" in said["unsealed_stolen"], said
    assert "is not a process of the preload" in said["sealed_stolen"], said
    refusals = [ln for ln in custodian_log(sockdir).splitlines()[before:] if "refused" in ln]
    assert len(refusals) == 5 and all(ln.count("\n") == 0 for ln in refusals), refusals

    first.kill()
    first.wait()
    second, how = start_held_daemon(_sock(sockdir), str(custodian.path), token=custodian.token)
    try:
        assert how == "ADOPTED" and block_digests(_sock(sockdir)) == served, "the replacement serves the real bytes"
    finally:
        second.kill()
        second.wait()


SEALS = {
    "none": (0, 4096, "is not sealed against writes, shrinking, growing"),
    "write only": ("W", 4096, "is not sealed against shrinking, growing"),
    "no grow": ("WS", 4096, "is not sealed against growing"),
    "larger than its block": ("WSG", 8192, "is 8192 bytes, its block says 4096"),
}


@pytest.mark.parametrize("case", SEALS, ids=list(SEALS))
def test_a_memfd_that_could_change_or_is_missized_is_refused(sockdir, custodian, case):
    import fcntl

    letters, size, message = SEALS[case]
    bits = {"W": fcntl.F_SEAL_WRITE, "S": fcntl.F_SEAL_SHRINK, "G": fcntl.F_SEAL_GROW}
    h, k, m = one_block(torch.arange(8, dtype=torch.int32))
    fd = sealed_memfd(size=size, seals=sum(bits[c] for c in letters or ""))
    before = custodian_log(sockdir).count("\n")
    with pytest.raises(CustodianError, match=message) as err:
        custodian.deposit(h, k, m, [fd], custodian.token)
    os.close(fd)
    assert "\n" not in str(err.value) and f"{NAME}: block 0" in str(err.value)
    assert custodian.holdings().holdings == []
    wait_for(lambda: custodian_log(sockdir).count("\n") > before, 5, "its log line")
    new = custodian_log(sockdir).splitlines()[before:]
    assert len(new) == 1 and "refused a deposit" in new[0] and message in new[0], new


def test_a_memfd_sealed_against_future_writes_is_held(sockdir, custodian):
    import fcntl

    from weightcache.custodian.checks import F_SEAL_FUTURE_WRITE

    h, k, m = one_block(torch.arange(8, dtype=torch.int32))
    fd = sealed_memfd(seals=F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    custodian.deposit(h, k, m, [fd], custodian.token)
    os.close(fd)
    assert [x.name for x in custodian.holdings().holdings] == [NAME]


def test_a_plain_file_is_not_a_block(sockdir, custodian, tmp_path):
    h, k, m = one_block(torch.arange(8, dtype=torch.int32))
    f = tmp_path / "block"
    f.write_bytes(b"\0" * 4096)
    fd = os.open(f, os.O_RDONLY)
    with pytest.raises(CustodianError, match="block 0 is not a sealable memfd"):
        custodian.deposit(h, k, m, [fd], custodian.token)
    os.close(fd)


def test_a_running_preloads_cache_and_credential_stay_its_own(sockdir, custodian):
    held_daemon(_sock(sockdir), KEY, custodian).close()
    other = register(sockdir)  # a second preload (of this process) may not replace the first one's cache
    h, k, m = one_block(torch.arange(8, dtype=torch.int32))
    h.block_bytes = [b for b in custodian.holdings().holdings[0].block_bytes]
    fd = sealed_memfd(size=h.block_bytes[0])
    with pytest.raises(CustodianError, match=f"{NAME} is held for the running preload pid {os.getpid()}"):
        other.deposit(h, k, _manifest_for(h.block_bytes), [fd], other.token)
    os.close(fd)
    code = ("import sys; from weightcache.custodian.client import CustodianClient as C\n"
            "try:\n C.connect(sys.argv[1]).register(sys.argv[2], 1.0); print('REGISTERED')\n"
            "except Exception as e: print(e)")
    got = subprocess.run([sys.executable, "-c", code, str(sockdir), custodian.token], capture_output=True,
                         text=True, timeout=60).stdout
    assert f"that credential belongs to the running preload pid {os.getpid()}" in got, got
    other.close()


def _manifest_for(blocks: list[int]) -> bytes:
    from weightcache.manifest import BlockSpec, Manifest

    return msgspec.msgpack.encode(Manifest(tensors=[], storages=[], blocks=[BlockSpec(n) for n in blocks]))


def test_the_adopting_daemon_checks_every_block_itself(sockdir, custodian, monkeypatch, caplog):
    """Should a bad block reach the custodian anyway, the replacement refuses it (one line), releases it and
    loads afresh."""
    d = held_daemon(_sock(sockdir), KEY, custodian)
    sizes = [b.nbytes for b in d.manifest.blocks]
    d.close()
    real_claim = CustodianClient.claim

    def claim_with_unsealed_blocks(self, name, token=""):
        claimed, fds = real_claim(self, name, token)
        for fd in fds:
            os.close(fd)
        return claimed, [sealed_memfd(size=n, seals=0) for n in sizes]

    monkeypatch.setattr(CustodianClient, "claim", claim_with_unsealed_blocks)
    again = Daemon(_sock(sockdir), KEY, custodian=custodian.path)
    again.start()
    with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
        assert not again.adopt()
    lines = [r.getMessage() for r in caplog.records if "refused the custodian's cache" in r.getMessage()]
    assert len(lines) == 1 and "block 0 is not sealed against writes" in lines[0], caplog.text
    assert custodian.holdings().holdings == [], "the refused cache is released"
    again.close()


@pytest.mark.gpu
def test_a_cuda_handle_is_checked_before_it_is_served():
    from weightcache.arena.adopted import check_blocks
    from weightcache.arena.cuda import CudaBlock, granularity
    from weightcache.errors import WeightCacheError

    torch.cuda.init()
    gran = granularity(0)
    block = CudaBlock(gran, 0)
    try:
        check_blocks([block.fd], [block.nbytes], "cuda", 0)  # the real thing passes
        with pytest.raises(WeightCacheError, match="block 0 is smaller than its block's"):
            check_blocks([block.fd], [2 * block.nbytes], "cuda", 0)
        fd = sealed_memfd(size=gran)
        with pytest.raises(WeightCacheError, match="block 1 is not a CUDA memory handle"):
            check_blocks([block.fd, fd], [block.nbytes, gran], "cuda", 0)
        os.close(fd)
    finally:
        block.close()
