"""Verified resident weights: the digest's definition against a plain reference, its native, torch and CUDA
implementations against the definition, and a daemon that finds bytes changed under it (a write through a
writable mapping, a poisoned deposit) and names the tensors."""

from __future__ import annotations

import ctypes
import json
import struct

import msgspec
import numpy as np
import pytest
import torch

from weightcache.integrity import algorithm, native
from weightcache.integrity import cuda as icuda

MASK = (1 << 64) - 1


def reference_digests(data: bytes, chunk: int) -> list[int]:
    """The definition, word by word in plain Python integers."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    out = []
    for start in range(0, len(data), chunk):
        piece = data[start:start + chunk]
        padded = piece + b"\0" * (-len(piece) % 8)
        acc = 0
        for j in range(len(padded) // 8):
            (w,) = struct.unpack_from("<Q", padded, 8 * j)
            acc = (acc + mix(w ^ ((0x243F6A8885A308D3 + j * 0x9E3779B97F4A7C15) & MASK))) & MASK
        out.append(mix(acc ^ len(piece)))
    return out


SIZES = [0, 1, 7, 8, 15, 16, 17, 100, 4095, 4096, 4097, 10_000]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("chunk", [16, 48, 1024])
def test_numpy_definition_matches_the_plain_reference(nbytes, chunk):
    data = np.random.default_rng(nbytes * 31 + chunk).integers(0, 256, nbytes, dtype=np.uint8)
    got = algorithm.digests_numpy(data, chunk)
    assert got.tolist() == reference_digests(data.tobytes(), chunk)
    assert len(got) == algorithm.chunk_count(nbytes, chunk)


def test_every_single_word_change_and_a_swap_change_the_digest():
    data = np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8)
    base = algorithm.digests_numpy(data, 256)[0]
    for i in range(0, 256, 8):
        for bit in (0, 7, 63):
            changed = data.copy().view("<u8")
            changed[i // 8] ^= np.uint64(1 << bit)
            assert algorithm.digests_numpy(changed.view(np.uint8), 256)[0] != base
    swapped = data.copy().view("<u8")
    swapped[[0, 1]] = swapped[[1, 0]]
    assert algorithm.digests_numpy(swapped.view(np.uint8), 256)[0] != base
    zeros = np.zeros(256, np.uint8)
    assert algorithm.digests_numpy(zeros, 256)[0] != algorithm.digests_numpy(zeros[:255], 256)[0]  # length counts


@pytest.mark.parametrize("nbytes", [0, 5, 4096, 65_536 + 24, 3 * 1024 * 1024 + 8])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_loop_matches_the_definition(nbytes, threads):
    lib, why = native.library()
    if lib is None:
        pytest.skip(f"no native digest: {why}")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    for chunk in (16, 4096, 1 << 20):
        acc = native.chunk_sums(data.ctypes.data, nbytes, chunk, threads=threads)
        got = algorithm.finalize(acc, algorithm.chunk_lengths(nbytes, chunk))
        assert got.tolist() == algorithm.digests_numpy(data, chunk).tolist()


def test_native_fallback_without_a_compiler_gives_the_same_numbers(monkeypatch):
    data = np.random.default_rng(2).integers(0, 256, 70_001, dtype=np.uint8)
    want = native.chunk_sums(data.ctypes.data, data.nbytes, 4096)
    monkeypatch.setattr(native, "library", lambda: (None, "no C compiler"))
    assert native.chunk_sums(data.ctypes.data, data.nbytes, 4096).tolist() == want.tolist()


@pytest.mark.parametrize("nbytes", [0, 9, 4096, 100_000])
def test_torch_fallback_matches_the_definition(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    for chunk in (16, 1024, 65_536):
        got = algorithm.finalize(icuda.torch_chunk_sums(data, chunk, slab_bytes=4 * chunk),
                                 algorithm.chunk_lengths(nbytes, chunk))
        assert got.tolist() == algorithm.digests_numpy(data.numpy(), chunk).tolist()


def test_the_kernel_compiles_with_nvrtc(tmp_path, monkeypatch):
    """Needs cuda-bindings and NVRTC (no GPU): the kernel's source compiles for Ampere and Hopper, and is cached."""
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    try:
        for arch in ("sm_80", "sm_90"):
            assert icuda.compile_kernel(arch)[:4] == b"\x7fELF"
    except icuda.KernelUnavailable as e:
        if "NVRTC unavailable" in str(e):
            pytest.skip(str(e))
        raise
    assert len(list(tmp_path.glob("digest-*-sm_90.cubin"))) == 1


class StandInDriver:
    """The driver calls of the digest kernel's path with host memory as "device" memory and the C loop as the
    "kernel": checks how the Python side allocates, packs the kernel's parameters, launches and reads back."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

    class CUmemLocationType:
        CU_MEM_LOCATION_TYPE_DEVICE = 1

    class CUmemAccess_flags:
        CU_MEM_ACCESS_FLAGS_PROT_READ = 1

    class _Location:
        type = id = 0

    class CUmemAccessDesc:
        def __init__(self):
            self.location, self.flags = StandInDriver._Location(), 0

    CUdeviceptr = CUstream = int

    def __init__(self):
        self.memory: dict[int, object] = {}  # address -> buffer kept alive
        self.launches: list[tuple] = []
        self.mapped: dict[int, int] = {}  # reserved address -> bytes

    def _alloc(self, n):
        buf = (ctypes.c_uint8 * n)()
        self.memory[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def cuInit(self, flags): return (0,)
    def cuDeviceGet(self, i): return 0, i
    def cuDevicePrimaryCtxRetain(self, dev): return 0, "ctx"
    def cuCtxPushCurrent(self, ctx): return (0,)
    def cuCtxPopCurrent(self): return 0, "ctx"
    def cuDeviceGetAttribute(self, attr, dev): return 0, 9 if attr == 75 else 0
    def cuModuleLoadData(self, image): return 0, "module"
    def cuModuleGetFunction(self, module, name): return 0, name
    def cuMemAlloc(self, n): return 0, self._alloc(n)
    def cuMemFree(self, addr):
        self.memory.pop(int(addr))
        return (0,)

    def cuMemsetD8Async(self, addr, value, n, stream):
        ctypes.memset(int(addr), value, n)
        return (0,)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        ptrs = np.ctypeslib.as_array((ctypes.c_uint64 * 5).from_address(params))
        address, nbytes, chunk, tiles, acc = (ctypes.c_uint64.from_address(int(p)).value for p in ptrs)
        n = algorithm.chunk_count(nbytes, chunk)
        assert (fn, gx, bx, tiles) == (icuda.FUNCTION, n * tiles, icuda.THREADS, -(-chunk // icuda.TILE_BYTES))
        sums = native.chunk_sums(address, nbytes, chunk)
        ctypes.memmove(acc, sums.ctypes.data, sums.nbytes)
        self.launches.append((nbytes, chunk, stream))
        return (0,)

    def cuStreamSynchronize(self, stream): return (0,)

    def cuMemcpyDtoH(self, dst, src, n):
        ctypes.memmove(dst, int(src), n)
        return (0,)

    def cuMemImportFromShareableHandle(self, fd, kind): return 0, fd
    def cuMemAddressReserve(self, n, align, addr, flags):
        base = self._alloc(n)
        self.mapped[base] = n
        return 0, base

    def cuMemMap(self, base, n, offset, handle, flags):
        data = os.pread(handle, n, 0)
        ctypes.memmove(int(base), data, len(data))
        return (0,)

    def cuMemSetAccess(self, base, n, descs, count):
        assert descs[0].flags == self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        return (0,)

    def cuMemUnmap(self, base, n): return (0,)
    def cuMemAddressFree(self, base, n):
        self.mapped.pop(int(base))
        self.memory.pop(int(base))
        return (0,)
    def cuMemRelease(self, handle): return (0,)
    def cuGetErrorName(self, err): return 0, b"CUDA_ERROR_STAND_IN"


def test_the_driver_path_with_a_stand_in_driver(monkeypatch):
    from types import SimpleNamespace

    from weightcache.integrity import resident

    fake = StandInDriver()
    monkeypatch.setattr(icuda, "_driver", lambda: fake)
    monkeypatch.setattr(icuda, "compile_kernel", lambda arch: b"cubin for " + arch.encode())
    monkeypatch.setattr(icuda, "_contexts", {})
    monkeypatch.setattr(icuda, "_functions", {})
    monkeypatch.setattr(icuda, "_buffers", {})
    data = np.random.default_rng(5).integers(0, 256, 3 * 4096 + 48, dtype=np.uint8)
    for chunk in (4096, 16, 1 << 20):
        got = icuda.device_sums(0, data.ctypes.data, data.nbytes, chunk, stream=7)
        assert got.tolist() == native.chunk_sums(data.ctypes.data, data.nbytes, chunk).tolist()
    assert fake.launches[-1] == (data.nbytes, 1 << 20, 7)
    with pytest.raises(ValueError, match="16-byte aligned"):
        icuda.device_sums(0, data.ctypes.data + 8, 64, 16)
    fd = os.memfd_create("wc-test")
    try:
        os.write(fd, data.tobytes())
        on_gpu = resident.fd_digests(fd, data.nbytes, SimpleNamespace(type="cuda", index=0), 4096)
        on_cpu = resident.fd_digests(fd, data.nbytes, SimpleNamespace(type="cpu", index=None), 4096)
        assert on_gpu.tolist() == on_cpu.tolist() == algorithm.digests_numpy(data, 4096).tolist()
    finally:
        os.close(fd)
    assert not fake.mapped, "the read-only mapping of the fd is undone"


def test_the_kernel_prepared_ahead_is_built_once(monkeypatch):
    """A daemon builds and loads the kernel while it starts; its first digest uses that one."""
    fake = StandInDriver()
    built = []
    monkeypatch.setattr(icuda, "_driver", lambda: fake)
    monkeypatch.setattr(icuda, "compile_kernel", lambda arch: built.append(arch) or b"cubin for " + arch.encode())
    monkeypatch.setattr(icuda, "_contexts", {})
    monkeypatch.setattr(icuda, "_functions", {})
    monkeypatch.setattr(icuda, "_buffers", {})
    icuda.prepare_kernel(0)
    assert len(built) == 1 and 0 in icuda._functions and not fake.launches
    data = np.arange(4096, dtype=np.uint8)
    got = icuda.device_sums(0, data.ctypes.data, data.nbytes, 1024)
    assert got.tolist() == native.chunk_sums(data.ctypes.data, data.nbytes, 1024).tolist()
    assert len(built) == 1


@pytest.mark.parametrize("bad", [0, -16, 8, 24, 2.0, True])
def test_bad_chunk_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="multiple of 16"):
        algorithm.digests_numpy(np.zeros(64, np.uint8), bad)


# ---- a daemon's resident bytes ----------------------------------------------------------------------------------

import fcntl  # noqa: E402
import logging  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import weightcache as wc  # noqa: E402
from conftest import DEVICES  # noqa: E402
from procs import bits, sample_tensors  # noqa: E402
from weightcache import cli, wire  # noqa: E402
from weightcache.arena.host import HostBlock  # noqa: E402
from weightcache.client import request_verify  # noqa: E402
from weightcache.custodian.client import CustodianClient  # noqa: E402
from weightcache.daemon import Daemon  # noqa: E402
from weightcache.errors import DaemonNotReady  # noqa: E402
from weightcache.integrity import IntegrityError  # noqa: E402
from weightcache.key import CacheKey  # noqa: E402
from weightcache.manifest import Manifest, validate  # noqa: E402
from weightcache.sockets import socket_name  # noqa: E402

KEY = CacheKey(model="sample", content_digest="d0")
CHUNK = 256  # small chunks: a change names only the tensors near it


def _sock(sockdir, device: str = "cpu"):
    """The socket path a daemon of KEY has (the custodian holds caches under it)."""
    return os.path.join(sockdir, socket_name(KEY, "cpu" if device == "cpu" else "0" * 8))


def _offset(manifest: Manifest, name: str) -> tuple[int, int]:
    """(block, byte offset) of a tensor's first element."""
    t = next(t for t in manifest.tensors if t.name == name)
    s = manifest.storages[t.storage]
    return s.block, s.offset + t.byte_offset


def _flip_cpu_byte(fd: int, offset: int) -> None:
    """Change one byte of a memfd through a shared writable mapping of it (any same-uid process can open an
    unsealed memfd read-write through /proc)."""
    rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        with mmap.mmap(rw, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            mm[offset] ^= 0x5A
    finally:
        os.close(rw)


@pytest.fixture
def unsealed(monkeypatch):
    """Host blocks left writable after their fill: a kernel without memfd seals, or a bug."""
    monkeypatch.setattr(HostBlock, "seal", lambda self: None)


@pytest.mark.parametrize("device", DEVICES)
def test_a_loaded_cache_records_digests_and_verifies_clean(sockdir, device):
    src = sample_tensors(device)
    with wc.publish(src, _sock(sockdir), KEY, digest_chunk_bytes=CHUNK) as d:
        m = d.manifest
        assert m.integrity == "wc-mix64-v1" and m.chunk_bytes == CHUNK
        assert all(len(b.digests) == 8 * -(-b.nbytes // CHUNK) for b in m.blocks)
        st = d.status()
        assert st.integrity == "wc-mix64-v1" and st.digest_seconds > 0 and st.verify_result == ""
        rep = request_verify(_sock(sockdir))
        assert (rep.checked, rep.ok, rep.mismatches, rep.nbytes) == (True, True, [], m.nbytes)
        with wc.attach(_sock(sockdir), expect=KEY, verify=True) as att:
            for name, t in src.items():
                assert torch.equal(bits(att[name]), bits(t)), name
        with wc.attach(_sock(sockdir), expect=KEY, mode="copy", verify=True) as att:
            assert torch.equal(bits(att["embed"]), bits(src["embed"]))
        st = d.status()
        assert (st.verify_result, st.verifications) == ("ok", 1) and st.verified_at > 0


def test_a_write_through_a_writable_mapping_is_caught_and_named(sockdir, unsealed, capsys):
    src = sample_tensors()
    with wc.publish(src, _sock(sockdir), KEY, digest_chunk_bytes=CHUNK) as d:
        block, at = _offset(d.manifest, "i32")
        _flip_cpu_byte(d._blocks[block].fd, at + 1)
        with pytest.raises(IntegrityError, match=r"1 tensor\(s\) differ from their recorded digests: 'i32'") as e:
            wc.attach(_sock(sockdir), expect=KEY, verify=True)
        assert e.value.tensors == ["i32"]
        assert cli.main(["verify", "--socket-dir", sockdir]) == 1
        out = capsys.readouterr().out
        assert "MISMATCH" in out and "'i32'" in out and "1 with changed weights" in out
        st = d.status()
        assert st.verify_result == "mismatch" and "'i32'" in st.verify_message
        with pytest.raises(DaemonNotReady, match="changed since they were loaded.*'i32'"):
            wc.attach(_sock(sockdir), expect=KEY)  # refused from now on, naming the tensor
        block, at = _offset(d.manifest, "embed")
        _flip_cpu_byte(d._blocks[block].fd, at)
        rep = request_verify(_sock(sockdir))
        assert not rep.ok and rep.mismatches[0].tensors == ["embed", "lm_head", "i32"]  # ties named, manifest order


def test_verify_json_and_a_clean_run_exit_zero(sockdir, capsys):
    with wc.publish(sample_tensors(), _sock(sockdir), KEY):
        assert cli.main(["verify", "--socket-dir", sockdir, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        (row,) = out["daemons"]
        assert row["result"] == "ok" and row["report"]["ok"] and out["mismatch"] == 0
        assert cli.main(["verify", "--socket-dir", sockdir]) == 0
        assert "OK" in capsys.readouterr().out


def test_verify_refuses_a_bad_directory_and_reports_unverifiable_daemons(sockdir, tmp_path, capsys):
    assert cli.main(["verify", "--socket-dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["verify", "--socket-dir", sockdir, "--timeout", "0"]) == 2
    assert "--timeout" in capsys.readouterr().err
    with wc.publish(sample_tensors(), _sock(sockdir), KEY, digest_chunk_bytes=0):  # records no digests
        assert cli.main(["verify", "--socket-dir", sockdir]) == 3
        assert "recorded no digests" in capsys.readouterr().out
        with pytest.raises(IntegrityError, match="recorded no digests"):
            wc.attach(_sock(sockdir), expect=KEY, verify=True)
        with wc.attach(_sock(sockdir), expect=KEY) as att:  # without verify it attaches as before
            assert len(att) == len(sample_tensors())


def test_a_daemon_still_loading_is_not_verified(sockdir):
    d = Daemon(_sock(sockdir), KEY)
    d.start()
    try:
        rep = request_verify(_sock(sockdir))
        assert not rep.checked and "loading" in rep.message
    finally:
        d.close()


def test_the_scrub_finds_a_change_in_the_background(sockdir, unsealed):
    with wc.publish(sample_tensors(), _sock(sockdir), KEY, digest_chunk_bytes=CHUNK, scrub_interval=0.05) as d:
        assert d.status().scrub_interval == 0.05
        deadline = time.monotonic() + 30
        while d.status().verifications == 0:
            assert time.monotonic() < deadline, "the scrub never ran"
            time.sleep(0.02)
        assert d.status().verify_result == "ok"
        block, at = _offset(d.manifest, "bias")
        _flip_cpu_byte(d._blocks[block].fd, at)
        while d.status().verify_result != "mismatch":
            assert time.monotonic() < deadline, "the scrub did not see the change"
            time.sleep(0.02)
        assert "'bias'" in d.status().verify_message


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "5", True])
def test_bad_scrub_intervals_are_refused(sockdir, bad):
    with pytest.raises(ValueError, match="scrub interval"):
        Daemon(_sock(sockdir), KEY, scrub_interval=bad)


def test_bad_digest_chunk_sizes_are_refused(sockdir):
    with pytest.raises(ValueError, match="multiple of 16"):
        Daemon(_sock(sockdir), KEY, digest_chunk_bytes=100)


def test_manifests_with_digests_that_do_not_cover_their_blocks_are_refused():
    from weightcache.manifest import BlockSpec

    def manifest(**kw):
        return Manifest([], [], [BlockSpec(4096, kw.pop("digests", b"\0" * 8 * 16))], **kw)

    validate(manifest(integrity="wc-mix64-v1", chunk_bytes=256))
    with pytest.raises(ValueError, match="chunks of 32 need 1024"):
        validate(manifest(integrity="wc-mix64-v1", chunk_bytes=32))
    with pytest.raises(ValueError, match="not a positive multiple"):
        validate(manifest(integrity="wc-mix64-v1", chunk_bytes=100))
    with pytest.raises(ValueError, match="names no digest algorithm"):
        validate(manifest())
    raw = wire.encode(wire.Attached(key=KEY, manifest=manifest(integrity="wc-mix64-v1", chunk_bytes=256), nfds=1))
    assert wire.decode(raw[4:]).manifest.blocks[0].digests == b"\0" * 128


# ---- a poisoned deposit -----------------------------------------------------------------------------------------


@pytest.fixture
def custodian(sockdir):
    """A custodian and our registered connection (we stand for the preload: our daemons carry its token)."""
    from test_custodian import registered_custodian

    yield from registered_custodian(sockdir)


def _poison(custodian_path, token: str, name: str, tensor: str) -> None:
    """What a process holding the preload's credential can do (a buggy or subverted daemon of it): claim the
    held cache (its key, manifest and blocks), and deposit under the same name sealed memfds with one byte of
    ``tensor`` changed, with the same key and manifest. The custodian's own checks (credential, seals, sizes)
    pass; only the digests tell."""
    client = CustodianClient.connect(custodian_path, client="poisoner")
    try:
        claimed, fds = client.claim(name, token)
        manifest = msgspec.msgpack.decode(claimed.manifest, type=Manifest)
        block, at = _offset(manifest, tensor)
        fakes = []
        for i, fd in enumerate(fds):
            data = bytearray(os.pread(fd, os.fstat(fd).st_size, 0))
            if i == block:
                data[at] ^= 0x5A
            fake = os.memfd_create("weightcache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fake, bytes(data))
            fcntl.fcntl(fake, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_SEAL)
            fakes.append(fake)
            os.close(fd)
        client.deposit(claimed.holding, claimed.key, claimed.manifest, fakes, token)
        for fd in fakes:
            os.close(fd)
    finally:
        client.close()


def test_a_poisoned_deposit_is_refused_and_loaded_afresh(sockdir, custodian, caplog):
    sock = _sock(sockdir)
    src = sample_tensors()
    first = Daemon(sock, KEY, custodian=custodian.path, digest_chunk_bytes=CHUNK)
    first.start()
    assert not first.adopt()
    first.load_tensors(src)
    assert first.held
    first.close()
    _poison(custodian.path, custodian.token, os.path.basename(sock), "half")
    second = Daemon(sock, KEY, custodian=custodian.path, digest_chunk_bytes=CHUNK)
    second.start()
    try:
        with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
            assert not second.adopt()  # refused: the caller loads afresh
        assert "is not the bytes that were loaded" in caplog.text and "'half'" in caplog.text
        second.load_tensors(src)
        with wc.attach(sock, expect=KEY, verify=True) as att:
            assert torch.equal(bits(att["half"]), bits(src["half"]))
    finally:
        second.close()
    third = Daemon(sock, KEY, custodian=custodian.path, digest_chunk_bytes=CHUNK)  # takes the fresh deposit
    third.start()
    try:
        assert third.adopt()
        assert third.status().verify_result == "ok"
        assert request_verify(sock).ok
        with wc.attach(sock, expect=KEY, verify=True) as att:
            assert torch.equal(bits(att["half"]), bits(src["half"]))
    finally:
        third.close()


def test_a_deposit_stripped_of_its_digests_is_not_adopted(sockdir, custodian, caplog):
    sock = _sock(sockdir)
    first = Daemon(sock, KEY, custodian=custodian.path)
    first.start()
    first.adopt()
    first.load_tensors(sample_tensors())
    first.close()
    client = CustodianClient.connect(custodian.path)
    claimed, fds = client.claim(os.path.basename(sock), custodian.token)
    manifest = msgspec.msgpack.decode(claimed.manifest, type=Manifest)
    manifest.integrity, manifest.chunk_bytes = "", 0
    for b in manifest.blocks:
        b.digests = b""
    client.deposit(claimed.holding, claimed.key, msgspec.msgpack.encode(manifest), fds, custodian.token)
    for fd in fds:
        os.close(fd)
    client.close()
    second = Daemon(sock, KEY, custodian=custodian.path)
    second.start()
    try:
        with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
            assert not second.adopt()
        assert "carries no digests" in caplog.text
    finally:
        second.close()


# ---- on a GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, 4095, 100_003, (3 << 20) + 40, (9 << 20) + 7])
def test_the_kernel_matches_the_definition_on_odd_sizes(nbytes):
    data = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    on_gpu = data.cuda()
    for start in (0, 16):  # a fresh allocation, and 16 bytes into one
        host, dev = data[start:start + nbytes], on_gpu[start:start + nbytes]
        for chunk in (16, 4096, 1 << 20, 4 << 20):
            lengths = algorithm.chunk_lengths(nbytes, chunk)
            want = algorithm.finalize(native.chunk_sums(host.data_ptr(), nbytes, chunk), lengths).tolist()
            assert algorithm.finalize(icuda.kernel_chunk_sums(dev, chunk), lengths).tolist() == want, (start, chunk)
            assert algorithm.finalize(icuda.torch_chunk_sums(dev, chunk), lengths).tolist() == want, (start, chunk)
    small = data[:min(nbytes, 5000)]
    assert algorithm.finalize(icuda.kernel_chunk_sums(small.cuda(), 48), algorithm.chunk_lengths(small.numel(), 48)
                              ).tolist() == reference_digests(small.numpy().tobytes(), 48)


@pytest.mark.gpu
def test_a_write_through_a_writable_cuda_mapping_is_caught(sockdir):
    sock = _sock(sockdir, "cuda")
    src = sample_tensors("cuda")
    with wc.publish(src, sock, KEY, digest_chunk_bytes=CHUNK):
        wc.attach(sock, expect=KEY, verify=True).close()
        writer = wc.attach(sock, expect=KEY, readonly=False)  # a shared writable mapping of the daemon's memory
        writer["i32"].view(torch.uint8)[1:2].bitwise_xor_(0x5A)
        torch.cuda.synchronize()
        with pytest.raises(IntegrityError, match=r"1 tensor\(s\) differ.*'i32'") as e:
            wc.attach(sock, expect=KEY, verify=True)
        assert e.value.tensors == ["i32"]
        rep = request_verify(sock)
        assert rep.checked and not rep.ok and rep.mismatches[0].tensors == ["i32"]
        with pytest.raises(DaemonNotReady, match="changed since they were loaded"):
            wc.attach(sock, expect=KEY)
        writer.close()


@pytest.mark.gpu
def test_a_changed_cuda_cache_is_not_adopted(sockdir, custodian, caplog):
    sock = _sock(sockdir, "cuda")
    src = sample_tensors("cuda")
    first = Daemon(sock, KEY, device="cuda", custodian=custodian.path, digest_chunk_bytes=CHUNK)
    first.start()
    assert not first.adopt()
    first.load_tensors(src)
    writer = wc.attach(sock, expect=KEY, readonly=False)
    first.close()  # the custodian holds the same memory the writer maps
    writer["half"].view(torch.uint8)[0:1].bitwise_xor_(0x5A)
    torch.cuda.synchronize()
    writer.close()
    second = Daemon(sock, KEY, device="cuda", custodian=custodian.path, digest_chunk_bytes=CHUNK)
    second.start()
    try:
        with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
            assert not second.adopt()
        assert "'half'" in caplog.text
        second.load_tensors(src)
        with wc.attach(sock, expect=KEY, verify=True) as att:
            assert torch.equal(bits(att["half"]), bits(src["half"]))
    finally:
        second.close()


# ---- the engines' option ----------------------------------------------------------------------------------------


def test_the_vllm_loader_takes_a_verify_option():
    pytest.importorskip("vllm")
    from weightcache.integrations.vllm.loader import Options

    assert Options.parse({}).verify is False
    assert Options.parse({"verify": "true"}).verify is True
    with pytest.raises(ValueError, match="'verify' must be true or false"):
        Options.parse({"verify": "sometimes"})


def test_transformers_verify_refuses_or_falls_back_on_changed_weights(sockdir, tmp_path, monkeypatch, unsealed):
    pytest.importorskip("transformers")
    import weightcache.transformers as wct
    from weightcache.integrations.transformers.producer import TransformersSource
    from weightcache.preload.layout import Placement
    from weightcache.sockets import device_tag, socket_path
    from weightcache.testing.checkpoints import make_llama_checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ckpt = make_llama_checkpoint(tmp_path / "ckpt", seed=3)
    src = TransformersSource(Placement("main", 0, 0, 0, False, 0, 1, 0, 0, "cpu", 1, 1, 1), path=str(ckpt), dtype="auto")
    key = src.key("dp1-pp1-tp1")
    d = Daemon(socket_path(sockdir, key, device_tag("cpu")), key, digest_chunk_bytes=CHUNK)
    d.start()
    try:
        src.produce(d)
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False, verify=True)
        assert model._weightcache_source == "attach"
        victim = next(t.name for t in d.manifest.tensors if t.name.endswith("norm.weight"))
        block, at = _offset(d.manifest, victim)
        _flip_cpu_byte(d._blocks[block].fd, at)
        with pytest.raises(IntegrityError, match=f"'{victim}'"):
            wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False, verify=True)
        with pytest.warns(wct.NoDaemonWarning, match=f"from disk: .*'{victim}'"):
            model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, verify=True)
        assert model._weightcache_source == "disk"
    finally:
        d.close()


# ---- preload: the scrub, /health and /metrics -------------------------------------------------------------------


def test_health_and_metrics_show_changed_weights():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from weightcache.preload.http import DaemonEntry, build_app

    def entry(rank, **kw):
        st = wire.DaemonStatus(state="ready", key=KEY.replace(rank=rank), device="cpu", pid=1, started_at=1.0, **kw)
        return DaemonEntry("main", rank, f"/tmp/x/main-r{rank}.sock", device="cpu", pid=1, status=st)

    current = [entry(0, verify_result="ok", verifications=3, verified_at=5.0, verify_seconds=0.01),
               entry(1, verify_result="mismatch", verify_message="1 tensor(s) differ: 'w'", verifications=1)]
    client = TestClient(build_app(lambda: current))
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["not_ready"] == ["main rank 1: weights changed (1 tensor(s) differ: 'w')"]
    values = {(s.name, s.labels.get("rank")): s.value for f in text_string_to_metric_families(client.get("/metrics").text)
              for s in f.samples}
    assert values[("weightcache_verify_ok", "0")] == 1.0 and values[("weightcache_verify_ok", "1")] == 0.0
    assert values[("weightcache_verifications_total", "0")] == 3.0
    current[1] = entry(1)  # never verified: no verify_ok sample, healthy
    assert client.get("/health").status_code == 200
    ok = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith("weightcache_verify_ok{")]
    assert len(ok) == 1 and 'rank="0"' in ok[0]


def test_preload_scrubs_and_verify_reports_every_rank(tmp_path):
    import httpx

    from test_supervisor import SMALL, Preload, free_port, stop_custodian
    from weightcache.testing.checkpoints import make_llama_checkpoint

    ckpt = make_llama_checkpoint(tmp_path / "ckpt", seed=0, **SMALL)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("XDG_RUNTIME_DIR", None)
    sdir, port = tmp_path / "s", free_port()
    p = Preload([ckpt, "-tp", "2", "--device", "cpu", "--engine", "safetensors", "--weight-cache-socket-dir", sdir,
                 "--weight-cache-health-port", port, "--weight-cache-scrub-interval", "0.2"], env, tmp_path)
    try:
        p.wait_ready()
        deadline = time.monotonic() + 60
        while True:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            ok = [ln for ln in metrics.splitlines() if ln.startswith("weightcache_verify_ok{")]
            if len(ok) == 2:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        assert all(ln.endswith(" 1.0") for ln in ok), ok
        out = subprocess.run([sys.executable, "-m", "weightcache.cli", "verify", "--socket-dir", str(sdir)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("OK ") == 2 and "2 ok, 0 with changed weights" in out.stdout
    finally:
        p.kill()
        stop_custodian(sdir)


def test_preload_refuses_a_bad_scrub_interval(capsys):
    from weightcache.cli import main

    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["preload", "/nonexistent", "--weight-cache-scrub-interval", bad])
        assert e.value.code == 2
        assert "--weight-cache-scrub-interval" in capsys.readouterr().err
