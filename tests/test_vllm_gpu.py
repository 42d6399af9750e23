"""vLLM on a GPU, really running vLLM (CUDA build): `weightcache preload --engine vllm` daemons (CUDA VMM
arenas, NCCL groups) and engines started with `--load-format weightcache`, each compared with the same engine
configuration loading from disk: greedy tokens, every reachable tensor byte for byte, the weight files never
opened by an attaching engine, the KV cache's capacity.

Runs wherever CUDA and vLLM are both present (skipped elsewhere). Every engine but the KV-capacity test's gets a
fixed KV cache (vLLM then skips its memory profiling, which counts other processes' allocations as its own), so the
tests can run side by side on one GPU; the KV-capacity test must run alone:

    python -m pytest -q -m "gpu and vllm" tests/test_vllm_gpu.py -n 6 --dist loadgroup -k "not kv_cache"
    python -m pytest -q -m "gpu and vllm" tests/test_vllm_gpu.py -k kv_cache
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from vllm_harness import (  # noqa: E402
    VLLM_FLAGS,
    Preload,
    cleanup,
    disk_reference,
    draft_spec,
    new_work,
    ok,
    openai_server_survives_daemon_kill,
    preload_with_draft,
    run_engine,
    sockdir,
    weight_files_opened,
)
from weightcache.client import query_status
from weightcache.integrations.model_state import parity
from weightcache.testing.checkpoints import make_llama_checkpoint, make_moe_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

# head_dim 64 and dimensions multiple of 128: FP8 GEMMs and FlashAttention take them as they are.
DENSE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=2, vocab_size=512,
             dtype=torch.bfloat16)
# a fixed KV cache (and a low utilization for vLLM's free-memory check at start-up): engines can share the GPU
SHARED_GPU = {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.15}
SHARED_GPU_FLAGS = ["--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.15"]
MOE = dict(hidden_size=256, num_layers=2, num_experts=8, experts_per_token=2, moe_intermediate_size=128,
           num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=512)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllmgpu")
    w = new_work(root, SHARED_GPU, tiny=str(make_llama_checkpoint(root / "tiny", seed=0, **DENSE)),
                 tiny2=str(make_llama_checkpoint(root / "tiny2", seed=1, **DENSE)))
    yield w
    cleanup(w)


@pytest.fixture(scope="module")
def daemons(work):
    p = preload_with_draft(work)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def disk(work):
    return disk_reference(work)


def _same_as_disk(work, name: str, model: str, sd: str, **spec) -> tuple[dict, dict]:
    ref = ok(run_engine(work, {"model": model, **spec, "dump": str(work["root"] / f"{name}-disk.pt")}))
    res = ok(run_engine(work, {"model": model, **spec, "load_format": "weightcache", "extra": {"socket_dir": sd},
                               "watch": [model], "dump": str(work["root"] / f"{name}-attach.pt")}))
    assert res["attached"] and res["tokens"] == ref["tokens"], (res["tokens"], ref["tokens"])
    assert weight_files_opened(res) == []
    a, b = torch.load(work["root"] / f"{name}-disk.pt"), torch.load(work["root"] / f"{name}-attach.pt")
    assert parity(a, b) == []
    return ref, res


@pytest.mark.xdist_group("main")
def test_bf16_dense(work, daemons, disk):
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": daemons.sockdir},
                               "watch": [work["tiny"]], "dump": str(work["root"] / "attach.pt")}))
    assert res["attached"] and res["tokens"] == disk["tokens"]
    assert weight_files_opened(res) == []
    assert parity(torch.load(work["root"] / "disk.pt"), torch.load(work["root"] / "attach.pt")) == []
    st = query_status(daemons.sockets()[0])
    assert st.device.startswith("cuda") and st.gpu_uuid and st.peak_device_bytes > 0


def test_online_fp8_dense(work):
    sd = sockdir(work, "fp8")
    pre = Preload(work, work["tiny"], sd, "--quantization", "fp8")
    try:
        _, res = _same_as_disk(work, "fp8", work["tiny"], sd, quantization="fp8")
        assert "fp8" in query_status(pre.sockets()[0]).key.quantization
    finally:
        pre.stop()


@pytest.mark.parametrize("arch, quantization", [("qwen3_moe", None), ("qwen3_moe", "fp8"), ("mixtral", None),
                                                ("mixtral", "fp8")])
def test_moe(work, arch, quantization):
    model = str(make_moe_checkpoint(work["root"] / f"moe-{arch}", arch, **MOE))
    sd = sockdir(work, f"moe{arch}{quantization or ''}")
    flags = ["--quantization", quantization] if quantization else []
    pre = Preload(work, model, sd, *flags)
    try:
        spec = {"quantization": quantization} if quantization else {}
        _same_as_disk(work, f"moe-{arch}-{quantization}", model, sd, **spec)
    finally:
        pre.stop()


@pytest.mark.xdist_group("main")
def test_draft_model_attaches_from_the_draft_group(work, daemons, disk):
    spec = draft_spec(work)
    ref = ok(run_engine(work, {"speculative_config": spec}))
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": daemons.sockdir},
                               "speculative_config": spec, "watch": [work["tiny"], work["tiny2"]]}))
    assert res["attached"] and res["draft_attached"]
    assert res["tokens"] == ref["tokens"] == disk["tokens"]  # greedy speculative decoding is lossless
    assert weight_files_opened(res) == []


def test_default_compilation_and_cuda_graphs(work, daemons):
    ref = ok(run_engine(work, {"enforce_eager": False}, timeout=900))
    res = ok(run_engine(work, {"enforce_eager": False, "load_format": "weightcache",
                               "extra": {"socket_dir": daemons.sockdir}}, timeout=900))
    assert res["attached"] and res["tokens"] == ref["tokens"]


def _kv_tokens_logged(res: dict) -> int:
    m = re.findall(r"GPU KV cache size: ([\d,]+) tokens", res["log"])
    return int(m[-1].replace(",", "")) if m else -1


def test_kv_cache_capacity_is_the_disk_loads(work):
    """At the same --gpu-memory-utilization the attaching engine gets the disk load's KV cache: the daemon's
    bytes are charged once (not ignored: the KV cache would grow by the weights; not twice: it would shrink)."""
    from weightcache.testing.checkpoints import llama_config_for_bytes

    shape = llama_config_for_bytes(4 << 30, torch.bfloat16)
    model = str(make_llama_checkpoint(work["root"] / "kv4g", dtype=torch.bfloat16, **shape))
    sd = sockdir(work, "kv")
    pre = Preload(work, model, sd)
    try:
        weights = query_status(pre.sockets()[0]).nbytes
        spec = {"model": model, "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": None}  # sized by vLLM
        ref = ok(run_engine(work, spec))
        res = ok(run_engine(work, {**spec, "load_format": "weightcache", "extra": {"socket_dir": sd}}))
        assert res["attached"] and res["tokens"] == ref["tokens"]
        per_block = (_kv_bytes_per_block(shape, ref["block_size"]))
        diff = abs(res["kv_blocks"] - ref["kv_blocks"]) * per_block
        print(f"KV cache: disk {ref['kv_blocks']} blocks ({_kv_tokens_logged(ref)} tokens logged), attach "
              f"{res['kv_blocks']} blocks ({_kv_tokens_logged(res)} tokens logged); weights {weights / 2**30:.2f} GiB")
        assert diff < 0.05 * weights, (ref["kv_blocks"], res["kv_blocks"], weights)
    finally:
        pre.stop()


def _kv_bytes_per_block(shape: dict, block_size: int) -> int:
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_heads"]
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * head_dim * 2 * block_size


def test_openai_server_keeps_serving_after_the_daemons_and_supervisor_die(work, disk):
    openai_server_survives_daemon_kill(work, work["tiny"], disk["tokens"], *SHARED_GPU_FLAGS, "--enforce-eager",
                                       engine_flags=VLLM_FLAGS)
