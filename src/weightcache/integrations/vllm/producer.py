"""Fill a daemon with the weights vLLM's own loader produces for one rank.

The daemon process forms its own distributed group (gloo on CPU, NCCL on CUDA) through the preload
supervisor's store on the weight-cache master port, builds the rank's model with vLLM's loader for the
configured ``--load-format`` (quantization and ``process_weights_after_loading`` included), and packs
every tensor the engine needs: parameters, buffers and tensors held as plain attributes of modules, of
their quantization methods and of the kernel objects those hold. Tensors reachable under several names are
packed once (aliases); views sharing a storage keep their strides and offsets.

Two things cannot cross a process boundary and are rebuilt by the engine instead, in vLLM's own
"weights already processed" mode (no tensor is transformed there): kernel handles that vLLM's CPU
backend makes from the weights (oneDNN / packed GEMMs; the daemon keeps the plain weights for them) and
host-side scalars such as ``_k_scale_float``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time

import torch
from torch import nn

from ...digests import safetensors_bytes
from ...errors import WeightCacheError
from ...key import CacheKey
from ...reader.settings import ReadSettings, reader_choice
from ...sources import Producer
from .. import model_state
from . import streamed
from .common import (
    META_FORMAT,
    META_NAME,
    UnsupportedQuantization,
    cache_key,
    check_quantization,
    draft_prefix,
    draft_vllm_config,
    python_state,
    reachable_tensors,
    state_changes,
)

log = logging.getLogger("weightcache.integrations.vllm.producer")

_ORIGINAL = "_weightcache_original"  # marks parameters that existed before post-processing: (dtype, shape)
_MAX_LISTED = 8
STREAMED_FORMATS = ("auto", "safetensors", "hf")  # load formats whose safetensors files our reader reads


# ---- identity ------------------------------------------------------------------------------------------------


# ---- what the engine needs -----------------------------------------------------------------------------------


def capture(model: nn.Module, before: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to pack (each object once) plus the side data the engine needs to rebind them:
    aliases, parameters created by loading (registered as plain ``nn.Parameter``s, they are not marked by
    ``build_model``), and, against ``before`` (the model as constructed), the host-side scalars loading
    set and the attributes it deleted. An object loading created that is neither a tensor, a scalar nor
    a known kernel handle cannot be shared: refused."""
    everything, all_roles = reachable_tensors(model)
    tensors, roles, aliases, skipped = model_state.split_aliases(everything, all_roles)
    if skipped:
        log.warning("not caching %d meta tensor(s) the loader left unset, e.g. %s", len(skipped),
                    ", ".join(skipped[:_MAX_LISTED]))
    replaced = sorted(n for n, r in roles.items()
                      if r == "parameter" and tensors[n].__dict__.pop(_ORIGINAL, None)
                      != (tensors[n].dtype, tuple(tensors[n].shape)))
    scalars, deleted, created, rebuilt = (state_changes(before, python_state(model)) if before is not None
                                          else ({}, [], [], []))
    if created:
        raise UnsupportedQuantization(
            "loading created state that cannot be shared between processes (not a tensor, scalar or known "
            f"kernel handle): {', '.join(created[:_MAX_LISTED])}; load this model from disk instead")
    meta = {"format": META_FORMAT, "aliases": aliases, "replaced": replaced, "meta_tensors": skipped,
            "scalars": scalars, "deleted": deleted, "rebuild": rebuilt}
    tensors[META_NAME] = model_state.side_data_tensor(meta, next((t.device for t in tensors.values()),
                                                                 torch.device("cpu")))
    roles[META_NAME] = "attribute"
    return tensors, roles


# ---- building a rank's model the way the engine would --------------------------------------------------------


def _defer_cpu_gemm_dispatch(model: nn.Module) -> list[nn.Module]:
    """vLLM's CPU backend turns each unquantized linear weight into a oneDNN/packed kernel handle in
    process_weights_after_loading and drops the weight; a handle cannot cross processes, so the daemon
    keeps the plain weight (vLLM's own per-layer switch) and the engine makes the handle."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    marked = []
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod) and \
                not getattr(module, "_cpu_skip_gemm_dispatch", False):
            module._cpu_skip_gemm_dispatch = True
            marked.append(module)
    return marked


@contextlib.contextmanager
def _accelerator_calls_without_accelerator():
    """vLLM's loader empties the accelerator's cache; on a CPU-only torch that raises, so (as vLLM's own CPU
    worker does) make those calls no-ops while loading."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or acc.is_available():
        yield
        return
    saved = {name: getattr(acc, name) for name in ("empty_cache", "synchronize") if hasattr(acc, name)}
    for name in saved:
        setattr(acc, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(acc, name, fn)


def build_model(vllm_config, model_config, *, prefix: str = "", read: ReadSettings | None = None, report=None,
                phases: dict | None = None) -> tuple[nn.Module, dict]:
    """The rank's model as vLLM's loader makes it (needs vLLM's distributed state and current config),
    and the snapshot of its Python state as constructed (see ``capture``).

    The loader's own ``load_model`` runs unchanged (construction, online quantization, layerwise and
    final post-processing as this vLLM release does them); its ``load_weights`` is wrapped to check the
    quantization methods and snapshot the model between construction and loading. With ``read``, the
    safetensors files its default loader picks are read by weightcache's reader (``streamed.py``)."""
    from vllm.model_executor.model_loader import get_model_loader

    load_config = vllm_config.load_config
    if load_config.load_format == "weightcache":
        raise WeightCacheError("the daemon loads from the checkpoint itself: drop --load-format weightcache "
                               "from the preload command (use the engine's real load format, or none)")
    loader = get_model_loader(load_config)
    device = torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)
    try:
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(device)
    except Exception as e:  # already initialised, or not needed on this platform
        log.debug("workspace manager: %s", e)
    seen: dict = {}
    load_weights = loader.load_weights
    phases = {} if phases is None else phases
    t0 = time.monotonic()

    def snapshot_then_load(model: nn.Module, mc) -> None:
        phases["construct"] = time.monotonic() - t0
        check_quantization(model)
        for p in model.parameters():
            p.__dict__[_ORIGINAL] = (p.dtype, tuple(p.shape))  # one reshaped in place counts as replaced
        seen["before"] = python_state(model)
        seen["marked"] = _defer_cpu_gemm_dispatch(model)
        t1 = time.monotonic()
        load_weights(model, mc)
        seen["loaded"] = time.monotonic()
        phases["load"] = seen["loaded"] - t1

    loader.load_weights = snapshot_then_load
    reading = contextlib.nullcontext()
    if read is not None and load_config.load_format in STREAMED_FORMATS:
        reading = streamed.read_with_weightcache(device, read, report, seen)
    with _accelerator_calls_without_accelerator(), reading:
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    if "loaded" in seen:
        phases["post-process"] = time.monotonic() - seen["loaded"]
    phases.update({k: v for k, v in seen.items() if k.startswith("load: ")})  # within "load": where it went
    if "before" not in seen:
        raise WeightCacheError(f"{type(loader).__name__}.load_model did not call load_weights: this loader "
                               "cannot be captured by weightcache")
    for m in seen["marked"]:
        del m._cpu_skip_gemm_dispatch
        m.__dict__.pop("cpu_linear", None)
    return model.eval(), seen["before"]


def _init_distributed(placement, master_addr: str, master_port: int, role: str, timeout_s: float) -> None:
    """The daemon group's own torch.distributed world, through the supervisor's store on the weight-cache
    master port; vLLM's model-parallel groups are then carved out of it as in the engine."""
    from datetime import timedelta

    import torch.distributed as dist
    from vllm.distributed import init_distributed_environment
    from vllm.platforms import current_platform

    backend = current_platform.dist_backend
    # vLLM's CPU shared-memory communicator names its segments after this.
    os.environ.setdefault("VLLM_DIST_IDENT", f"weightcache-{role}-{master_port or os.getpid()}")
    if not dist.is_initialized():
        if master_port:
            store = dist.TCPStore(master_addr, master_port, None, False, timeout=timedelta(seconds=timeout_s))
        elif placement.world_size == 1:  # a rank alone, planned without the supervisor's store
            store = dist.HashStore()
        else:
            raise WeightCacheError(f"{role}: {placement.world_size} ranks need the supervisor's store port")
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"weightcache/{role}/vllm-pg/", store),
                                world_size=placement.world_size, rank=placement.rank,
                                timeout=timedelta(seconds=timeout_s))
    init_distributed_environment(world_size=placement.world_size, rank=placement.rank,
                                 local_rank=placement.local_index, backend=backend)


class VllmSource(Producer):
    """One rank of one role, built in the daemon process. ``produce(daemon)`` builds, packs, frees."""

    def __init__(self, placement, *, vllm_config, role: str, master_addr: str, master_port: int,
                 timeout_s: float = 600.0, reader: str | None = None):
        self.placement = placement
        self.reader = reader_choice(reader)  # who reads the checkpoint: weightcache's reader or vLLM
        self.vllm_config = vllm_config
        self.role = role
        self.master_addr = master_addr
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.startup_phases: dict[str, float] = {}  # the daemon's start before its load (vllm_frontend fills it)

    def _rank_config(self):
        from vllm.config import replace

        cfg = self.vllm_config
        p = self.placement
        if cfg.parallel_config.data_parallel_size > 1:  # the engine sets these on each DP rank's workers
            pc = replace(cfg.parallel_config, data_parallel_rank=p.dp_rank,
                         data_parallel_rank_local=p.dp_rank % max(1, cfg.parallel_config.data_parallel_size_local))
            cfg = replace(cfg, parallel_config=pc)
        if self.role == "draft":
            draft = draft_vllm_config(cfg)
            if draft is None:
                raise WeightCacheError("role 'draft' without a draft model in --speculative-config")
            return draft, draft.speculative_config.draft_model_config, draft_prefix(cfg)
        return cfg, cfg.model_config, ""

    def key(self) -> CacheKey:
        cfg, model_config, _ = self._rank_config()
        return cache_key(cfg, model_config, role=self.role, rank=self.placement.rank)

    def produce(self, daemon) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized

        p = self.placement
        daemon.phases.update(self.startup_phases)
        try:
            if p.device.startswith("cuda"):
                torch.cuda.set_device(p.local_index)
            t0 = time.monotonic()
            _init_distributed(p, self.master_addr, self.master_port, self.role, self.timeout_s)
            daemon.phases["start: distributed"] = time.monotonic() - t0
            cfg, model_config, prefix = self._rank_config()
            with set_current_vllm_config(cfg):
                ensure_model_parallel_initialized(cfg.parallel_config.tensor_parallel_size,
                                                  cfg.parallel_config.pipeline_parallel_size)
                daemon.begin_load(safetensors_bytes(model_config.model))  # its peak counts the model's build too
                began = time.monotonic()
                read = ReadSettings.make(progress=p.local_index == 0) if self.reader == "weightcache" else None
                model, before = build_model(cfg, model_config, prefix=prefix, read=read, report=daemon._progress,
                                            phases=daemon.phases)
            t1 = time.monotonic()
            tensors, roles = capture(model, before)
            del before
            if p.device.startswith("cuda"):
                torch.cuda.empty_cache()  # post-processing's transients must not sit under the first arena block
            daemon.phases["capture"] = time.monotonic() - t1
            log.info("%s rank %d: %d tensors (%.1f MiB) from vLLM's loader (%s read the checkpoint)", self.role,
                     p.rank, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
                     "weightcache's reader" if read is not None else "vLLM")
        except BaseException as e:
            daemon.fail(f"{type(e).__name__}: {e}")
            raise
        daemon.load_tensors(tensors, roles, consume=True, began=began)
        # The weights live in the arena now (each source storage was freed once packed): drop the model
        # (attention layers sit in the config's context).
        del tensors, model
        try:
            cfg.compilation_config.static_forward_context.clear()
        except AttributeError:
            pass
        gc.collect()
        if p.device.startswith("cuda"):
            torch.cuda.empty_cache()


def make_source(placement, **kwargs) -> VllmSource:
    """Module-level factory for the preload supervisor (runs in the daemon process)."""
    return VllmSource(placement, **kwargs)


def make_key(source: VllmSource, placement, *, layout: str, role: str, **_) -> CacheKey:
    """The daemon's key, computed as the engine computes it (see ``cache_key``)."""
    key = source.key()
    if key.layout != layout or key.role != role:
        raise WeightCacheError(f"vLLM's config gives layout {key.layout} / role {key.role} but the preload "
                               f"planned {layout} / {role}")
    return key
