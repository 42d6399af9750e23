"""The quantized checkpoints people download, on a GPU with vLLM (CUDA build; 0.26 on Hopper): for each method a
random checkpoint in its tool's own layout (``weightcache.testing.quantized``: compressed-tensors FP8 / INT8 /
W4A16, GPTQ 4 and 8 bit with and without act-order, AWQ, ModelOpt FP8, FP8 KV-cache scales), dense (Qwen3) and
MoE (Qwen3-MoE, Mixtral), is preloaded with `weightcache preload --engine vllm` while the same engine
configuration loads it from disk; then an engine attaches it. Both engines run with CUDA graphs (vLLM's default
compilation): the same greedy tokens, every tensor the forward reads byte for byte (``model_state.parity``), no
weight file opened by the attaching engine. A method whose post-load state cannot be captured is refused by the
preload in one line, before its weights are read; a config that does not match its tensors fails with vLLM's own
error. Each case prints the quantization methods and kernels vLLM chose (``-rP`` shows them).

One preload and two engine processes per case; the cases are independent (pytest-xdist runs them side by side,
each engine with a fixed 1 GiB KV cache). Subsets by id, e.g. ``-k dense``, ``-k "moe or mixtral"``,
``-k "gptq or awq"``, ``-k refused``:

    python -m pytest -q -rP -m "gpu and vllm" tests/test_vllm_quant_gpu.py -n 6 -k "<subset>"
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from vllm_harness import (  # noqa: E402
    VLLM_FLAGS,
    Preload,
    cleanup,
    new_work,
    ok,
    run_engine,
    sockdir,
    weight_files_opened,
)
from weightcache.client import query_status  # noqa: E402
from weightcache.integrations.model_state import parity  # noqa: E402
from weightcache.testing import quantized as q  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

# head_dim 64, every dimension a multiple of 128: Machete, Marlin, CUTLASS and FlashAttention 3 take them as they are
DENSE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512, num_layers=2,
             vocab_size=512)
MOE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8, experts_per_token=2,
           moe_intermediate_size=128, num_layers=2, vocab_size=512)
ARCH = {"dense": ("qwen3", DENSE), "moe": ("qwen3_moe", MOE), "mixtral": ("mixtral", MOE)}
SHARED_GPU = {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.15, "enforce_eager": False,
              "max_tokens": 8}
NO_MACHETE = {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}  # Marlin, as on GPUs before Hopper

# id: (maker, maker options, extra environment of the preload and both engines)
METHODS = {
    "ct-fp8-channel": ("ct-fp8", {}, {}),  # llm-compressor FP8-dynamic
    "ct-fp8-tensor": ("ct-fp8", {"strategy": "tensor"}, {}),
    "ct-fp8-tensor-static-kv": ("ct-fp8", {"strategy": "tensor", "dynamic": False, "kv_cache": True}, {}),
    "ct-int8": ("ct-int8", {}, {}),
    "ct-int8-static": ("ct-int8", {"dynamic": False}, {}),
    "ct-w4a16": ("ct-wna16", {}, {}),
    "ct-w4a16-asym": ("ct-wna16", {"symmetric": False}, {}),
    "ct-w4a16-act": ("ct-wna16", {"actorder": True}, {}),
    "gptq4": ("gptq", {}, {}),
    "gptq4-act": ("gptq", {"desc_act": True}, {}),
    "gptq8": ("gptq", {"bits": 8}, {}),
    "gptq8-act": ("gptq", {"bits": 8, "desc_act": True}, {}),
    "gptq4-act-marlin": ("gptq", {"desc_act": True}, NO_MACHETE),
    "awq": ("awq", {}, {}),
    "awq-marlin": ("awq", {}, NO_MACHETE),
    "modelopt-fp8-kv": ("modelopt-fp8", {}, {}),
    "fp8-block": ("fp8-block", {}, {}),  # DeepSeek-V3 / Qwen3-FP8
}
DENSE_CASES = [f"dense-{m}" for m in METHODS]
MOE_CASES = [f"moe-{m}" for m in ("ct-fp8-channel", "ct-fp8-tensor-static-kv", "ct-int8", "ct-w4a16",
                                   "ct-w4a16-act", "gptq4", "gptq4-act", "gptq8", "awq", "modelopt-fp8-kv",
                                   "fp8-block")]
MIXTRAL_CASES = ["mixtral-ct-w4a16", "mixtral-gptq4", "mixtral-ct-fp8-channel"]
KERNEL_LINES = re.compile(r"(Using \S+ for \S+|Selected \S+ for \S+|Using '[^']+' \S+ MoE backend|"
                          r"Using \S+(?:Experts|MoE)\S*)")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = new_work(tmp_path_factory.mktemp("vllmquant"), SHARED_GPU, tiny="")
    yield w
    cleanup(w)


def _checkpoint(work, case: str) -> tuple[str, dict]:
    arch, method = case.split("-", 1)
    kind, opts, env = METHODS[method]
    family, shape = ARCH[arch]
    if arch != "dense" and (opts.get("desc_act") or opts.get("actorder")):
        shape = {**shape, "moe_intermediate_size": 256}  # Marlin's MoE kernel takes act-order with > 1 group along K
    path = q.MAKERS[kind](work["root"] / case, family, **opts, **shape)
    return str(path), env


def _with_env(work, env: dict) -> dict:
    return {**work, "env": {**work["env"], **env}} if env else work


def _kernels(res: dict) -> list[str]:
    return sorted(set(KERNEL_LINES.findall(res.get("log", ""))))


@pytest.mark.parametrize("case", DENSE_CASES + MOE_CASES + MIXTRAL_CASES)
def test_attach_generates_what_a_disk_load_generates(work, case):
    model, env = _checkpoint(work, case)
    w = _with_env(work, env)
    sd = sockdir(w, case[:12])
    dumps = {k: str(w["root"] / f"{case}-{k}.pt") for k in ("disk", "attach")}
    with ThreadPoolExecutor(1) as pool:  # the disk engine runs while the daemon loads (waited for on the way out)
        disk = pool.submit(run_engine, w, {"model": model, "watch": [model], "dump": dumps["disk"]}, timeout=900)
        pre = Preload(w, model, sd, timeout=600)
        try:
            ref = ok(disk.result())
            res = ok(run_engine(w, {"model": model, "load_format": "weightcache", "extra": {"socket_dir": sd},
                                    "watch": [model], "dump": dumps["attach"]}, timeout=900))
            st = query_status(pre.sockets()[0])
        finally:
            pre.stop()
    assert weight_files_opened(ref), "the open watcher saw no weight file opened by the disk load"
    assert res["attached"] and res["tokens"] == ref["tokens"], (res["tokens"], ref["tokens"])
    assert weight_files_opened(res) == []
    a, b = torch.load(dumps["disk"]), torch.load(dumps["attach"])
    assert parity(a, b) == []
    assert st.key.quantization != "none" and "kernels" in st.key.extra
    print(f"QUANT {case}: tokens {ref['tokens'][0]}, {len(a)} tensors equal, {st.nbytes / 2**20:.1f} MiB held, peak {st.peak_device_bytes / 2**20:.1f} MiB; "
          f"{'; '.join(_kernels(ref))}")


def _preload_fails(work, model: str, *flags: str, timeout: float = 600) -> str:
    sd = sockdir(work, "fail")
    r = subprocess.run([sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", model, *VLLM_FLAGS,
                        "--weight-cache-socket-dir", sd, *flags], capture_output=True, text=True,
                       env=work["env"], timeout=timeout)
    assert r.returncode != 0 and "READY" not in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert not list(Path(sd).glob("*.sock"))
    return r.stderr


@pytest.mark.parametrize("case, flags, names", [
    pytest.param("refused-ct-fp8-weight-only", (), ("CompressedTensorsLinearMethod/CompressedTensorsW8A16Fp8",
                                                    "8 layer(s)"), id="refused-ct-fp8-weight-only"),
    pytest.param("refused-experts-int8", ("--quantization", "experts_int8"), ("Int8OnlineMoEMethod", "2 layer(s)"),
                 id="refused-experts-int8"),
])
def test_a_method_that_cannot_be_captured_is_refused_in_one_line(work, case, flags, names):
    if "experts" in case:
        from weightcache.testing.checkpoints import make_moe_checkpoint

        model = str(make_moe_checkpoint(work["root"] / case, "qwen3_moe", **MOE))
    else:
        model = str(q.make_compressed_fp8_checkpoint(work["root"] / case, "qwen3", weight_only=True, **DENSE))
    err = _preload_fails(work, model, *flags)
    lines = [ln for ln in err.splitlines() if "cannot capture the post-load state" in ln]
    assert lines, err[-4000:]
    line = lines[-1]
    assert all(n in line for n in names) and "load this model from disk instead" in line, line
    assert "Loading weights took" not in err  # refused before the weights were read


def test_mismatch_a_config_that_does_not_match_its_tensors_fails_with_vllms_error(work):
    """A GPTQ checkpoint whose config says 8 bits over 4-bit tensors: vLLM's own loading error, passed through."""
    model = q.make_gptq_checkpoint(work["root"] / "mismatch", "qwen3", **DENSE)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (model / "config.json").write_text(json.dumps(cfg))
    err = _preload_fails(work, str(model))
    failed = [ln for ln in err.splitlines() if "exited with code" in ln]
    assert failed and "UnsupportedQuantization" not in failed[-1], err[-4000:]
    print(f"QUANT mismatch: {failed[-1].strip()}")
