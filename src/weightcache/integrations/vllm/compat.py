"""What differs between the vLLM releases weightcache supports (0.26 to 0.34), detected by capability.

- vLLM 0.32+ has a "weights already processed" mode: ``process_weights_after_loading`` then skips tensor
  transforms and only rebuilds kernel objects. Where it is missing (0.26), the MoE kernels are rebuilt the way
  each method's post-processing ends, and Machete's activation permutation from the attached ``g_idx``
  (``rebuild_kernels``).
- vLLM 0.33+ asks the model loader for the bytes it maps from outside (``get_external_weight_memory``) and
  takes them out of the ``--gpu-memory-utilization`` budget; 0.34 also tracks charges and disk fallbacks. Where
  the hook is missing, the GPU worker's budget function is wrapped to do the same
  (``install_memory_budget_shim``), so an attaching engine gets the KV cache a disk load would.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import math
import sys
from collections.abc import Callable

log = logging.getLogger("vllm.weightcache")

TESTED = ((0, 26), (0, 34))  # oldest and newest minor release tested or read


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def version_note(version: str) -> str | None:
    """A one-line warning for a vLLM outside the tested range, else None."""
    minor = _minor(version)
    lo, hi = TESTED
    if minor is not None and lo <= minor <= hi:
        return None
    return (f"weightcache is tested with vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; this is vLLM {version}: "
            "loading may fail or be refused")


@functools.cache
def warn_if_untested() -> None:
    import vllm

    note = version_note(getattr(vllm, "__version__", "unknown"))
    if note:
        log.warning(note)


def has_pre_processed_mode() -> bool:
    try:
        from vllm.model_executor.utils import weights_already_processed  # noqa: F401
    except ImportError:
        return False
    return True


def has_external_memory_hook() -> bool:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    return hasattr(BaseModelLoader, "get_external_weight_memory")


# ---- kernels the engine rebuilds ---------------------------------------------------------------------------


def rebuild_kernels(layer, owner=None) -> None:
    """Make the objects a layer's quantization method (``owner``: it, or a linear kernel it holds) built from its
    processed weights, from the weights now bound to the layer; no tensor is transformed."""
    qm = layer.quant_method
    if has_pre_processed_mode():
        from vllm.model_executor.utils import weights_already_processed

        with weights_already_processed():
            qm.process_weights_after_loading(layer)
        return
    owner = qm if owner is None else owner
    if owner is not qm:
        _rebuild_linear_kernel(layer, owner)
        return
    _rebuild_moe_kernel(layer, qm)


def _rebuild_linear_kernel(layer, kernel) -> None:
    """Machete with activation order (vLLM 0.26 ``MacheteLinearKernel.process_weights_after_loading``): the
    activations are permuted by argsort(g_idx) through a closure; g_idx itself is attached untransformed."""
    import torch

    c = getattr(kernel, "config", None)
    gidx_name = getattr(kernel, "w_gidx_name", None)
    if not (getattr(c, "has_g_idx", False) and gidx_name and getattr(layer, gidx_name, None) is not None):
        _cannot_rebuild(kernel)
    from vllm import _custom_ops as ops

    perm = torch.argsort(getattr(layer, gidx_name)).to(torch.int)
    kernel.act_perm = lambda x: x[:, perm]
    permute_cols = getattr(ops, "permute_cols", None)  # a CUDA op: absent where Machete cannot run anyway
    if permute_cols is not None and c.act_type in (torch.float16, torch.bfloat16) and \
            c.partition_weight_shape[0] % 8 == 0:
        kernel.act_perm = functools.partial(permute_cols, perm=perm)


def _rebuild_moe_kernel(layer, qm) -> None:
    """The MoE kernels, the way each method's post-processing ends on vLLM 0.26 (after its tensor transforms)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    routing = layer._expert_routing_tables() if hasattr(layer, "_expert_routing_tables") else None
    experts_cls = getattr(qm, "experts_cls", None)
    if isinstance(qm, UnquantizedFusedMoEMethod) and experts_cls is not None:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import make_unquantized_moe_kernel

        qm.moe_quant_config = qm.get_fused_moe_quant_config(layer)
        qm.moe_kernel = make_unquantized_moe_kernel(
            quant_config=qm.moe_quant_config, moe_config=qm.moe, backend=qm.unquantized_backend,
            experts_cls=experts_cls, routing_tables=routing)
    elif getattr(qm, "fp8_backend", None) is not None and experts_cls is not None:  # FP8, CT FP8, ModelOpt FP8
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import make_fp8_moe_kernel

        qm.moe_quant_config = qm.get_fused_moe_quant_config(layer)
        if qm.moe_quant_config:
            qm.moe_kernel = make_fp8_moe_kernel(
                moe_quant_config=qm.moe_quant_config, moe_config=qm.moe, fp8_backend=qm.fp8_backend,
                experts_cls=experts_cls, routing_tables=routing, layer=layer)
    elif getattr(qm, "wna16_moe_backend", None) is not None and callable(getattr(qm, "_setup_kernel", None)):
        qm._setup_kernel(layer)  # GPTQ / AWQ MoE: builds the kernel from the layer's processed tensors only
    elif getattr(qm, "wna16_backend", None) is not None and experts_cls is not None:  # compressed-tensors WNA16
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
            WNA16MoEBackend,
            make_wna16_moe_kernel,
        )

        qm.moe_quant_config = qm.get_fused_moe_quant_config(layer)
        marlin_args = {} if qm.wna16_backend == WNA16MoEBackend.FLASHINFER_TRTLLM else {
            "w13_g_idx": layer.w13_weight_g_idx, "w2_g_idx": layer.w2_weight_g_idx,
            "w13_g_idx_sort_indices": layer.w13_g_idx_sort_indices,
            "w2_g_idx_sort_indices": layer.w2_g_idx_sort_indices, "is_k_full": qm.is_k_full}
        qm.moe_kernel = make_wna16_moe_kernel(moe_quant_config=qm.moe_quant_config, moe_config=qm.moe,
                                              experts_cls=experts_cls, routing_tables=routing, **marlin_args)
    elif getattr(qm, "int8_backend", None) is not None and experts_cls is not None:  # compressed-tensors INT8
        from vllm.model_executor.layers.fused_moe.oracle.int8 import make_int8_moe_kernel

        qm.moe_quant_config = qm.get_fused_moe_quant_config(layer)
        qm.moe_kernel = make_int8_moe_kernel(
            int8_backend=qm.int8_backend, moe_quant_config=qm.moe_quant_config, moe_config=qm.moe,
            experts_cls=experts_cls, routing_tables=routing, layer=layer)
    else:
        _cannot_rebuild(qm)


def _cannot_rebuild(obj) -> None:
    from ...errors import WeightCacheError

    raise WeightCacheError(f"{type(obj).__name__}: this vLLM has no pre-processed weights mode and weightcache "
                           "cannot rebuild this method's kernels; load this model from disk instead")


# ---- the memory budget on releases without the loader hook ------------------------------------------------


def engine_budget(total: int, free: int, utilization: float, external: int) -> int:
    """The engine's own share of ``--gpu-memory-utilization`` when ``external`` bytes of its weights are
    held by daemons (already in use on the device, so not in ``free``): as vLLM 0.33's request_memory."""
    requested = math.ceil(total * utilization)
    engine = requested - external
    if engine <= 0:
        raise ValueError(f"weights held by the weight cache ({external / 2**30:.2f} GiB) exceed the "
                         f"--gpu-memory-utilization budget ({utilization}, {requested / 2**30:.2f} GiB); "
                         "raise --gpu-memory-utilization")
    if free < engine:
        raise ValueError(f"free memory on the device ({free / 2**30:.2f} GiB) is less than the engine's budget "
                         f"after the weight cache's {external / 2**30:.2f} GiB ({engine / 2**30:.2f} GiB); lower "
                         "--gpu-memory-utilization or free memory used by other processes")
    return engine


GPU_WORKER = "vllm.v1.worker.gpu_worker"
_shim_state = {"installed": False}
ExternalMemory = Callable[[object, object], int]  # (load_config, vllm_config) -> bytes the daemons hold for it


def install_memory_budget_shim(external_memory: ExternalMemory) -> bool:
    """On a vLLM whose GPU worker does not ask the loader for external weight memory, wrap its budget
    function (for ``--load-format weightcache`` the daemons' bytes, as ``external_memory`` reports them,
    come out of the budget) as soon as the GPU worker module is imported: never importing it here (plugins
    load early, in every vLLM process). Returns whether the shim is (or will be) in place."""
    if _shim_state["installed"]:
        return True
    if has_external_memory_hook():
        return False
    _shim_state["installed"] = True
    module = sys.modules.get(GPU_WORKER)
    if module is not None:
        _wrap_request_memory(module, external_memory)
    else:
        sys.meta_path.insert(0, _WrapOnImport(external_memory))
    return True


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the GPU worker module's request_memory right after the module is executed."""

    def __init__(self, external_memory: ExternalMemory):
        self.external_memory = external_memory

    def find_spec(self, name, path, target=None):
        if name != GPU_WORKER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module):
            exec_module(module)
            _wrap_request_memory(module, self.external_memory)

        spec.loader.exec_module = exec_then_wrap
        return spec


def _wrap_request_memory(gpu_worker, external_memory: ExternalMemory) -> None:
    original = getattr(gpu_worker, "request_memory", None)
    if original is None:
        log.warning("this vLLM's GPU worker has neither get_external_weight_memory nor request_memory: the KV "
                    "cache of an engine attaching weights may be sized as if the weights were its own")
        return

    @functools.wraps(original)
    def request_memory(init_snapshot, cache_config, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
        load_config = getattr(cfg, "load_config", None)
        if getattr(load_config, "load_format", None) != "weightcache":
            return original(init_snapshot, cache_config, *args, **kwargs)
        external = external_memory(load_config, cfg)
        if not external:
            return original(init_snapshot, cache_config, *args, **kwargs)
        engine = engine_budget(init_snapshot.total_memory, init_snapshot.free_memory,
                               cache_config.gpu_memory_utilization, external)
        log.info("weights held by the weight cache: %.2f GiB of the %.2f GiB --gpu-memory-utilization budget; "
                 "%.2f GiB remain for this engine", external / 2**30,
                 math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization) / 2**30,
                 engine / 2**30)
        return engine

    gpu_worker.request_memory = request_memory


def record_charge(socket_path: str, is_draft: bool, nbytes: int) -> None:
    """vLLM 0.34 tracks each external weight charge (so a later disk fallback can return it)."""
    with contextlib.suppress(ImportError):
        from vllm.model_executor.model_loader.weight_cache.utils import record_external_weight_charge

        record_external_weight_charge(socket_path, is_draft, nbytes)


def record_fallback(socket_path: str, is_draft: bool) -> None:
    with contextlib.suppress(ImportError):
        from vllm.model_executor.model_loader.weight_cache.utils import record_external_weight_fallback

        record_external_weight_fallback(socket_path, is_draft)
