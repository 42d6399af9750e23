"""What the vLLM daemon (producer.py) and the engine's loader (loader.py) share: the cache key, the side data's name and format, the walking rules and the quantization check."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ...digests import checkpoint_digest, config_digest
from ...dtypes import dtype_name
from ...errors import WeightCacheError
from ...key import CacheKey
from .. import model_state
from ..model_state import Rules, walkable_in
from .quantization import (  # noqa: F401 (the producer and the loader import these from here)
    REBUILT_ATTRIBUTES,
    SCRATCH_ATTRIBUTES,
    UnsupportedQuantization,
    check_quantization,
    kernel_choice,
)

ENGINE = "vllm"
META_NAME = "__weightcache__.vllm"  # JSON side data (aliases, replaced parameters) as a uint8 tensor
META_FORMAT = 1

# Runtime state bound by the engine's model runner, not weights.
SKIP_ATTRIBUTES = frozenset({"kv_cache"})
_MAX_DEPTH = 3


def local_checkpoint_dir(model_config) -> Path:
    """The local directory holding the model's files (a Hugging Face id is looked up in the local cache)."""
    model = str(model_config.model)
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=model_config.revision, local_files_only=True))
    except Exception as e:
        raise WeightCacheError(
            f"{model}: not a local directory and not in the local Hugging Face cache ({e}); "
            "download it first (the preload does) or pass a directory") from None


def model_label(model_config) -> str:
    model = str(model_config.model)
    return str(Path(model).resolve()) if os.path.isdir(model) else model


def quantization_field(model_config) -> str:
    """'none', or the method plus a digest of the checkpoint's and the runtime's quantization config.

    Computed before any loading: post-processing may mutate the config."""
    method = model_config.quantization
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    runtime = getattr(model_config, "quantization_config", None)
    if method is None and hf_quant is None and runtime is None:
        return "none"
    if hasattr(hf_quant, "to_dict"):
        hf_quant = hf_quant.to_dict()
    return f"{method or 'auto'}:{config_digest({'checkpoint': hf_quant, 'runtime': runtime})}"


def layout_string(parallel_config) -> str:
    """``dp{D}-pp{P}-tp{T}`` (+ ``-ep{D*T}``), as ``Layout.describe()`` writes it."""
    dp = parallel_config.data_parallel_size
    tp = parallel_config.tensor_parallel_size
    s = f"dp{dp}-pp{parallel_config.pipeline_parallel_size}-tp{tp}"
    return s + (f"-ep{dp * tp}" if parallel_config.enable_expert_parallel else "")


def cache_key(vllm_config, model_config, *, role: str, rank: int) -> CacheKey:
    """The key both sides compute: the daemon from its config, the engine from its own."""
    import vllm

    hf = model_config.hf_config
    extra = {
        "arch": ",".join(getattr(hf, "architectures", None) or []),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "kernels": kernel_choice(vllm_config),
    }
    return CacheKey(
        model=model_label(model_config),
        content_digest=checkpoint_digest(local_checkpoint_dir(model_config)),
        revision=model_config.revision or "",
        dtype=dtype_name(model_config.dtype),
        quantization=quantization_field(model_config),
        layout=layout_string(vllm_config.parallel_config),
        rank=rank,
        role=role,
        engine=ENGINE,
        engine_version=vllm.__version__,
        extra=extra,
    )


def draft_vllm_config(vllm_config):
    """The VllmConfig the engine's drafter builds its model with (None without a draft model)."""
    from vllm.config import replace

    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return None
    if hasattr(spec, "apply_draft_overrides"):
        cfg = spec.apply_draft_overrides(vllm_config)
    else:  # vLLM 0.26: the overrides its proposer's _create_draft_vllm_config applies
        cfg = vllm_config
        if getattr(spec, "moe_backend", None) is not None:
            cfg = replace(cfg, kernel_config=replace(cfg.kernel_config, moe_backend=spec.moe_backend))
        if hasattr(cfg, "attention_config"):
            cfg = replace(cfg, attention_config=replace(cfg.attention_config,
                                                        backend=getattr(spec, "attention_backend", None)))
    if spec.method == "draft_model":  # as vLLM's DraftModelProposer
        cfg = replace(cfg, quant_config=None, model_config=spec.draft_model_config,
                      parallel_config=replace(spec.draft_parallel_config, rank=vllm_config.parallel_config.rank))
    return cfg


def draft_prefix(vllm_config) -> str:
    spec = vllm_config.speculative_config
    return "draft_model" if spec is not None and spec.method == "draft_model" else ""


def _walkable(obj) -> bool:
    """Plain vLLM objects (quantization methods, kernels) whose attributes may hold tensors."""
    return _WALKABLE(obj)


_WALKABLE = walkable_in("vllm")
# Kernel handles vLLM's CPU backend makes from the weights; the engine makes its own (see the engine).
KERNEL_ATTRIBUTES = frozenset({"cpu_linear"})
RULES = Rules(walkable=_WALKABLE, skip=SKIP_ATTRIBUTES, rebuilt=REBUILT_ATTRIBUTES, engine_made=KERNEL_ATTRIBUTES,
              max_depth=_MAX_DEPTH)


def python_state(model: nn.Module) -> dict[str, dict[str, tuple]]:
    """Per owner path (modules and the plain vLLM objects they hold), each attribute's kind: a tensor,
    a host-side scalar (with its value) or another object (held, so identity can be compared)."""
    return model_state.python_state(model, RULES)


def state_changes(before: dict, after: dict) -> tuple[dict[str, dict], list[str], list[str], list[str]]:
    """(host-side scalars set or changed, attributes deleted, objects created, owners whose kernels the
    engine rebuilds) between two snapshots."""
    return model_state.state_changes(before, after, RULES)


def reachable_tensors(model: nn.Module, *, rebuilt: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor the model's forward can read, by every name it is reachable under, with its role:
    parameters, buffers, and tensors held as plain attributes of modules and of the plain vLLM objects
    they hold (quantization methods, kernels), up to a few levels deep. Kernels the engine rebuilds
    (REBUILT_ATTRIBUTES) are walked only with ``rebuilt`` (for parity checks)."""
    return model_state.reachable_tensors(model, RULES, include_rebuilt=rebuilt)


def read_meta(tensors: Mapping[str, torch.Tensor]) -> dict:
    return model_state.read_side_data(
        tensors, META_NAME, META_FORMAT, "vLLM",
        "the daemon's tensors carry no vLLM side data: not a `preload --engine vllm` cache")
