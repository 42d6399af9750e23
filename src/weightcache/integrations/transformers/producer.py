"""Fill a daemon with the model transformers' own ``from_pretrained`` builds for one rank.

The daemon runs ``AutoModelForCausalLM.from_pretrained`` with the engine's configuration (dtype, device,
attention and experts implementation; for tensor parallelism transformers' own plan over the daemon
group's torch.distributed world), so weight conversions (fused MoE experts, renamings), the quantizer's
processing (FP8 block scales, dequantization), keep-in-fp32 modules and tied weights are exactly
transformers'. It then captures every tensor the forward reads (parameters, buffers, tensors kept as plain
attributes), the Python state that loading set, and moves the tensors into the arena at ~1x peak memory
(``Daemon.load_tensors(consume=True)``). The engine builds the same model on the meta device through the
same ``from_pretrained`` and binds them (``weightcache.integrations.transformers.engine``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from ...digests import safetensors_bytes
from ...errors import WeightCacheError
from ...key import CacheKey
from ...reader.settings import ReadSettings, reader_choice
from ...sources import Producer
from .. import model_state
from . import streamed
from .compat import (
    META_FORMAT,
    META_NAME,
    RULES,
    LoadingSteps,
    UnsupportedModel,
    intercept_loading,
    key_for_checkpoint,
    load_kwargs,
    resolve_dtype,
    unwrap_local,
)
from .config import model_modules

log = logging.getLogger("weightcache.integrations.transformers.producer")

_MAX_LISTED = 8


class _Observe(LoadingSteps):
    """The daemon's side: transformers' own steps, with the model's Python state recorded just before the
    checkpoint is read and just after loading is finalized (what the engine re-applies). With ``read``
    settings, the checkpoint's safetensors files are read by weightcache's reader, streamed to ``device``
    (``streamed.py``); transformers' loading converts and places each tensor as it always does."""

    def __init__(self, device: torch.device | None = None, read: ReadSettings | None = None, report=None):
        self.before: dict | None = None
        self.after: dict | None = None
        self.conversions_used: list[int] = []
        self.device, self.read, self.report = device, read, report
        self.phases: dict[str, float] = {}
        self.reread = 0
        self._t0 = time.monotonic()

    def load(self, original, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        self.phases["construct"] = time.monotonic() - self._t0
        t0 = time.monotonic()
        self.before = model_state.python_state(model, RULES)
        stream = None
        if self.read is not None and state_dict is None and checkpoint_files:
            got = streamed.streamed_state_dict(checkpoint_files, self.device, self.read, self.report)
            if got is not None:
                state_dict, stream = got
                checkpoint_files = None
        try:
            with streamed.no_allocator_warmup() if stream is not None else contextlib.nullcontext():
                out = original(model, state_dict, checkpoint_files, load_config, expected_keys)
        finally:
            if stream is not None:
                stream.close()
                streamed.release_held()
                self.reread = stream.reread
        self.phases["load"] = time.monotonic() - t0
        if stream is not None:  # within "load": where its time went
            self.phases.update({f"load: {k}": v for k, v in stream.timings.items()})
        self._t1 = time.monotonic()
        # the conversions that matched the checkpoint, kept on the model for saving it again
        used = getattr(model, "_weight_conversions", None) or []
        self.conversions_used = [i for i, c in enumerate(load_config.weight_mapping or ())
                                 if any(c is u for u in used)]
        return out

    def finalize(self, original, model, *args, **kwargs):
        info = original(model, *args, **kwargs)
        self.after = model_state.python_state(model, RULES)
        self._t2 = time.monotonic()
        self.phases["finalize"] = self._t2 - getattr(self, "_t1", self._t0)
        return info


def build_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device, attn_implementation=None,
                experts_implementation=None, trust_remote_code: bool = False, revision: str | None = None,
                distributed_config=None, read: ReadSettings | None = None, report=None
                ) -> tuple[nn.Module, _Observe]:
    """The model ``AutoModelForCausalLM.from_pretrained`` builds, and the Python state it had before and
    after its weights were loaded. ``read``: read the checkpoint with weightcache's reader (else
    transformers reads it itself); ``report(nbytes)``: bytes read so far."""
    from transformers import AutoModelForCausalLM

    observe = _Observe(device, read, report)
    kw = load_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation,
                     experts_implementation=experts_implementation, trust_remote_code=trust_remote_code,
                     revision=revision, distributed_config=distributed_config)
    with intercept_loading(observe):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw)
    if hasattr(observe, "_t2"):
        observe.phases["after finalize"] = time.monotonic() - observe._t2
    if observe.before is None or observe.after is None:
        raise UnsupportedModel(f"{type(model).__name__}.from_pretrained did not run transformers' loading steps; "
                               "this model cannot be captured")
    return model, observe


def capture(model: nn.Module, before: dict, after: dict, conversions_used=()
            ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to pack (each object once; a DTensor's local shard) plus the side data the engine needs:
    aliases (tied weights), and between ``before`` and ``after`` loading, the host-side scalars it set and
    the attributes it deleted. An object loading created that is neither a tensor nor a scalar is refused,
    naming the module and attribute."""
    scalars, deleted, created, _ = model_state.state_changes(before, after, RULES)
    if created:
        raise UnsupportedModel(
            "loading set state the cache cannot carry to another process (not a tensor or a scalar): "
            f"{', '.join(created[:_MAX_LISTED])}; load this model from disk instead")
    everything, all_roles = model_state.reachable_tensors(model, RULES)
    tensors, roles, aliases, on_meta = model_state.split_aliases(everything, all_roles, local=unwrap_local)
    if on_meta:
        raise UnsupportedModel(f"transformers left {len(on_meta)} tensor(s) on the meta device after loading, e.g. "
                               f"{', '.join(on_meta[:_MAX_LISTED])}")
    meta = {"format": META_FORMAT, "aliases": aliases, "scalars": scalars, "deleted": deleted,
            "weight_conversions": list(conversions_used),
            # parameters loading left without gradients (the rest: floating-point ones have them)
            "frozen": sorted(n for n, t in everything.items() if isinstance(t, nn.Parameter) and not t.requires_grad
                             and (t.is_floating_point() or t.is_complex())),
            "dtensors": sorted(n for n in tensors if unwrap_local(everything[n]) is not everything[n])}
    device = next((t.device for t in tensors.values()), torch.device("cpu"))
    tensors[META_NAME] = model_state.side_data_tensor(meta, device)
    roles[META_NAME] = "attribute"
    return tensors, roles


def _init_distributed(placement, master_addr: str, master_port: int, role: str, timeout_s: float) -> None:
    """The daemon group's torch.distributed world (gloo on CPU, NCCL on CUDA) through the preload
    supervisor's store on the weight-cache master port; transformers builds its device mesh over it."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if placement.device.startswith("cuda") else "gloo"
    store = dist.TCPStore(master_addr, master_port, None, False, timeout=timedelta(seconds=timeout_s))
    os.environ.setdefault("LOCAL_RANK", str(placement.local_index))  # transformers picks its device by it
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"weightcache/{role}/hf-pg/", store),
                            world_size=placement.world_size, rank=placement.rank,
                            timeout=timedelta(seconds=timeout_s))


def distributed_config_for(placement, enable_expert_parallel: bool = False):
    """transformers' DistributedConfig for a placement (None without tensor parallelism)."""
    if placement.tp_size == 1:
        return None
    from transformers.distributed import DistributedConfig

    kw = {"tp_size": placement.tp_size, "tp_plan": "auto"}
    if enable_expert_parallel:
        kw["ep_size"] = placement.tp_size
    return DistributedConfig(**kw)


class TransformersSource(Producer):
    """One rank of one role, built in the daemon process by transformers' ``from_pretrained``;
    ``produce(daemon)`` builds, captures, packs and frees."""

    def __init__(self, placement, *, path: str, dtype: str = "auto", revision: str = "",
                 attn_implementation: str | None = None, experts_implementation: str | None = None,
                 trust_remote_code: bool = False, enable_expert_parallel: bool = False,
                 master_addr: str = "127.0.0.1", master_port: int = 0, role: str = "main",
                 timeout_s: float = 600.0, reader: str | None = None):
        self.placement = placement
        self.reader = reader_choice(reader)  # who reads the checkpoint: weightcache's reader or transformers
        self.path = Path(path)
        self.dtype = resolve_dtype(self.path, None if dtype in ("", "auto") else dtype)
        self.revision = revision
        self.attn_implementation = attn_implementation
        self.experts_implementation = experts_implementation
        self.trust_remote_code = trust_remote_code
        self.enable_expert_parallel = enable_expert_parallel
        self.master_addr, self.master_port = master_addr, master_port
        self.role = role
        self.timeout_s = timeout_s
        self.device = torch.device(placement.device)

    def key(self, layout: str) -> CacheKey:
        return key_for_checkpoint(self.path, dtype=self.dtype, layout=layout, rank=self.placement.rank,
                                  role=self.role, revision=self.revision or None, device=self.device,
                                  experts_implementation=self.experts_implementation)

    def produce(self, daemon) -> None:
        p = self.placement
        try:
            dist_config = None
            if p.tp_size > 1:
                _init_distributed(p, self.master_addr, self.master_port, self.role, self.timeout_s)
                dist_config = distributed_config_for(p, self.enable_expert_parallel)
            t0 = time.monotonic()
            for module in model_modules(self.path):  # pre-imported while the daemon waited, or now
                with contextlib.suppress(ImportError):  # from_pretrained says what is missing
                    importlib.import_module(module)
            began = time.monotonic()
            daemon.phases["imports"] = began - t0
            read = None
            if self.reader == "weightcache":
                read = ReadSettings.make(progress=p.local_index == 0)
                daemon.begin_load(safetensors_bytes(self.path))
            model, seen = build_model(self.path, dtype=self.dtype, device=self.device,
                                      attn_implementation=self.attn_implementation,
                                      experts_implementation=self.experts_implementation,
                                      trust_remote_code=self.trust_remote_code, revision=self.revision or None,
                                      distributed_config=dist_config, read=read, report=daemon._progress)
            daemon.phases.update(seen.phases)
            t1 = time.monotonic()
            tensors, roles = capture(model, seen.before, seen.after, seen.conversions_used)
            daemon.phases["capture"] = time.monotonic() - t1
            log.info("%s rank %d: %d tensors (%.1f MiB) from transformers' from_pretrained (%s read the checkpoint"
                     "%s)", self.role, p.rank, len(tensors),
                     sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
                     "weightcache's reader" if read is not None else "transformers",
                     f"; {seen.reread} tensor(s) read twice" if seen.reread else "")
        except BaseException as e:
            daemon.fail(f"{type(e).__name__}: {e}")
            raise
        daemon.load_tensors(tensors, roles, consume=True, began=began)
        del tensors, model  # every source storage was freed once packed
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def make_source(placement, **kwargs) -> TransformersSource:
    """Module-level factory for the preload supervisor (runs in the daemon process)."""
    return TransformersSource(placement, **kwargs)


def make_key(source: TransformersSource, placement, *, layout: str, role: str, **_) -> CacheKey:
    """The daemon's key, computed as the engine computes it (``key_for_checkpoint``)."""
    if role != source.role:
        raise WeightCacheError(f"the source was built for role {source.role}, the preload planned {role}")
    return source.key(layout)
