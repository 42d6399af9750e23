"""transformers engine: ``from_pretrained`` over weights a daemon holds.

``weightcache.transformers.from_pretrained(path, device=..., dtype=...)`` returns the model that
``AutoModelForCausalLM.from_pretrained`` builds, without reading the checkpoint's weight files when a daemon
holds them (``weightcache preload --model PATH``). It is transformers' own ``from_pretrained``: config,
quantizer module replacement, keep-in-fp32 plan, weight conversion mapping, the model built on the meta
device, generation config and the quantizer's post-processing all run as transformers runs them; only the
step that reads the checkpoint (and the one that finalizes it) is replaced by binding the tensors the
daemon's own ``from_pretrained`` produced — every parameter, buffer and tensor attribute, zero-copy with
``mode="map"`` — and re-applying the Python state its loading set (see ``weightcache.integrations.transformers.producer``).

``key_for_checkpoint`` is the cache identity of a checkpoint served for this engine; ``weightcache preload``
(engine "transformers") computes its key with the same function, so both sides agree.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from pathlib import Path

import torch

from ...client import attach
from ...errors import DaemonNotReady, DaemonUnavailable, KeyMismatch, PermissionDenied, WeightCacheError
from ...integrity import IntegrityError
from ...sockets import default_socket_dir, device_tag, find_socket, socket_path
from ..model_state import (
    apply_deletions,
    apply_scalars,
    bind_captured,
    leftover_meta,
    owner_of,
    read_side_data,
)
from ..torch import BindError
from .compat import (
    META_FORMAT,
    META_NAME,
    LoadingSteps,
    engine_version,
    intercept_loading,
    key_for_checkpoint,
    load_kwargs,
    read_config,
    resolve_dtype,
    skip_init_on_meta,
    snapshot_revision,
)

log = logging.getLogger("weightcache.integrations.transformers.engine")


class NoDaemonWarning(UserWarning):
    """from_pretrained fell back to reading the checkpoint from disk."""


# ---- building the model ---------------------------------------------------------------------------------------


def _local_dir(path, revision: str | None) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if isinstance(path, str) and path.count("/") == 1 and not p.exists():
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(path, revision=revision, local_files_only=True))
        except Exception as e:
            raise FileNotFoundError(
                f"{path}: not a local directory and not in the local Hugging Face cache ({e})"
            ) from None
    raise FileNotFoundError(f"checkpoint directory not found: {path}")


def _resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, not {device}")
    return device


class _Bind(LoadingSteps):
    """The engine's side of ``from_pretrained``: instead of reading the checkpoint, bind the daemon's tensors
    into the model transformers just built on the meta device (quantizer modules and tensor parallel
    placeholders included) and re-apply the Python state its loading set; transformers' finalize step (tie,
    initialise missing and non-persistent tensors) is not run: the daemon's tensors are all of them."""

    def __init__(self, tensors, roles, meta: dict):
        self.tensors, self.roles, self.meta = tensors, roles, meta
        self.bound: dict[str, torch.Tensor] = {}
        self.seconds = {}
        self.called = False

    def load(self, original, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        from transformers.utils.loading_report import LoadStateDictInfo

        t0 = time.perf_counter()
        self.called = True
        self.seconds["skeleton_done"] = t0
        meta = self.meta
        frozen = set(meta.get("frozen", ()))
        apply_deletions(model, meta.get("deleted", ()))
        try:
            self.bound = bind_captured(
                model, self.tensors, self.roles, meta, skip=frozenset({META_NAME}),
                requires_grad=lambda name, t: name not in frozen and (t.is_floating_point() or t.is_complex()),
                wrap=_dtensor_like if meta.get("dtensors") else None)
        except WeightCacheError as e:
            raise BindError(str(e)) from None
        apply_scalars(model, meta.get("scalars", {}))
        mapping = list(load_config.weight_mapping or ())
        used = meta.get("weight_conversions", [])
        if any(i >= len(mapping) for i in used):
            raise BindError(f"the daemon used weight conversions {used} but this engine has {len(mapping)}: "
                            "it was built with another transformers configuration")
        model._weight_conversions = [mapping[i] for i in used]
        left = leftover_meta(model)
        if left:
            raise BindError(f"the cache lacks {len(left)} tensor(s) this model reads, e.g. {', '.join(left[:5])}: "
                            "the daemon was built for another configuration", missing=left)
        self.seconds["bind"] = time.perf_counter() - t0
        info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), error_msgs=[],
                                 conversion_errors={}, skipped_pp_keys=set())
        return info, None

    def finalize(self, original, model, load_config, loading_info):
        return loading_info


def _dtensor_like(old, t: torch.Tensor) -> torch.Tensor:
    """A rank's attached shard as the DTensor transformers' tensor parallel plan made of this parameter."""
    if getattr(old, "device_mesh", None) is None or not hasattr(old, "placements"):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                              stride=tuple(old.stride()))


def build(model_dir: str | Path, tensors, roles, meta: dict, *, device: torch.device, dtype: torch.dtype,
          attn_implementation: str | None = None, experts_implementation: str | None = None,
          trust_remote_code: bool = False, revision: str | None = None, distributed_config=None,
          hf_kwargs: dict | None = None):
    """``AutoModelForCausalLM.from_pretrained(model_dir, ...)`` with captured tensors (a daemon's, see
    ``weightcache.integrations.transformers.producer``) bound instead of the checkpoint read; returns (model, seconds:
    "skeleton" = from the call to the model built on meta, "bind", "rest" = transformers' steps after)."""
    from transformers import AutoModelForCausalLM

    steps = _Bind(tensors, roles, meta)
    kw = load_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation,
                     experts_implementation=experts_implementation, trust_remote_code=trust_remote_code,
                     revision=revision, distributed_config=distributed_config, extra=hf_kwargs)
    t0 = time.perf_counter()
    with intercept_loading(steps), skip_init_on_meta():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw)
    t_end = time.perf_counter()
    if not steps.called:
        raise BindError(f"{type(model).__name__}.from_pretrained did not run transformers' loading step; "
                        "the cached weights could not be bound")
    replaced = _replaced(model, steps.bound)
    if replaced:
        raise BindError(f"transformers' post-processing replaced {len(replaced)} bound tensor(s), e.g. "
                        f"{', '.join(replaced[:5])}: this model's quantizer changes weights after loading, which "
                        "the cache cannot share")
    seconds = {"skeleton": steps.seconds["skeleton_done"] - t0, "bind": steps.seconds["bind"]}
    seconds["rest"] = t_end - steps.seconds["skeleton_done"] - seconds["bind"]
    return model, seconds


def _replaced(model, bound: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bound tensor the model no longer holds (replaced after loading)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    out = []
    for name, t in bound.items():
        try:
            obj, leaf = owner_of(model, modules, name)
        except WeightCacheError:
            out.append(name)
            continue
        if getattr(obj, leaf, None) is not t:
            out.append(name)
    return out


def _from_disk(path, device: torch.device, dtype: torch.dtype, kwargs: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), **load_kwargs(dtype=dtype, device=device, extra=kwargs))
    model.__dict__["_weightcache_source"] = "disk"
    return model


def _parallel_sizes(layout: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(dp|pp|tp)(\d+)", layout)}


def _distributed_config(layout: str, rank: int):
    """transformers' tensor parallel config for an engine rank of ``layout`` (None without TP)."""
    sizes = _parallel_sizes(layout)
    tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
    if pp > 1 or (tp > 1 and sizes.get("dp", 1) > 1):
        raise WeightCacheError(
            f"layout {layout}: from_pretrained binds whole models or transformers' own tensor parallel ranks "
            "(pp1, and dp1 with tp > 1)")
    if tp == 1:
        return None
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized() or dist.get_world_size() != tp or dist.get_rank() != rank:
        raise WeightCacheError(
            f"layout {layout} rank {rank}: a tensor parallel engine runs in a torch.distributed world of "
            f"{tp} processes (torchrun --nproc-per-node {tp}) whose rank is the cache's rank")
    return DistributedConfig(tp_size=tp, tp_plan="auto", **({"ep_size": tp} if "-ep" in layout else {}))


def from_pretrained(
    path,
    *,
    device=None,
    dtype=None,
    socket_dir=None,
    fallback: bool = True,
    mode: str = "map",
    readonly: bool = True,
    wait: float = 600.0,
    timeout: float = 10.0,
    verify: bool = False,
    revision: str | None = None,
    layout: str = "dp1-pp1-tp1",
    rank: int = 0,
    role: str = "main",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    **hf_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` on ``device``, with the weights taken from
    the weight cache daemon that holds this checkpoint (``weightcache preload --model PATH``).

    ``device``: the daemon's device (default: the current CUDA device, else cpu). ``dtype``: as transformers
    ("auto" by default). ``socket_dir``: where daemons live (default: the per-user directory).
    ``fallback``: without a daemon for this checkpoint (none, another version, not ready within ``wait``
    seconds, failed) load from disk with a warning; ``fallback=False`` raises instead. ``mode="map"`` binds
    the daemon's memory zero-copy and read-only (an engine that writes weights needs ``mode="copy"``).
    ``verify=True`` re-hashes the attached weights on ``device`` against the digests the daemon recorded at
    load before binding them: a mismatch (IntegrityError, naming the tensors) loads from disk with ``fallback``.
    ``layout``/``rank``: a tensor parallel rank (``dp1-pp1-tp2``, rank = this process's torch.distributed
    rank) binds its shards into transformers' own tensor parallel model. The model keeps the attachment
    (``model._weightcache_attachment``); ``model._weightcache_source`` is "attach" or "disk";
    ``model._weightcache_timings`` has the phases (seconds)."""
    if mode not in ("map", "copy"):
        raise ValueError(f"mode must be 'map' or 'copy', not {mode!r}")
    dist_config = _distributed_config(layout, rank)
    t0 = time.perf_counter()
    model_dir = _local_dir(path, revision)
    device = _resolve_device(device)
    torch_dtype = resolve_dtype(model_dir, dtype, config=read_config(model_dir))
    model_kwargs = dict(hf_kwargs)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        model_kwargs["experts_implementation"] = experts_implementation
    if trust_remote_code:
        model_kwargs["trust_remote_code"] = True
    if revision is not None:
        model_kwargs["revision"] = revision

    sdir = Path(socket_dir) if socket_dir is not None else default_socket_dir()
    key = key_for_checkpoint(model_dir, dtype=torch_dtype, layout=layout, rank=rank, role=role, revision=revision,
                             device=device, experts_implementation=experts_implementation)
    tag = device_tag(device)
    t_key = time.perf_counter()
    wanted = socket_path(sdir, key, tag)
    problem: Exception | None = None
    try:
        sock = find_socket(sdir, key, tag)
        att = attach(sock, expect=key, mode=mode, readonly=readonly, wait=wait, timeout=timeout, verify=verify)
    except DaemonUnavailable as e:
        problem = DaemonUnavailable(
            f"no weight cache daemon holds {model_dir} ({key.dtype}, {layout} rank {rank}) for {device}: tried "
            f"{wanted} ({e}); start one with `weightcache preload --model {model_dir} --dtype {key.dtype} "
            f"--weight-cache-socket-dir {sdir}`"
        )
    except (KeyMismatch, DaemonNotReady, PermissionDenied, IntegrityError) as e:
        problem = e
    if problem is not None:
        if not fallback:
            raise problem
        warnings.warn(f"weightcache: loading {model_dir} from disk: {problem}", NoDaemonWarning, stacklevel=2)
        if dist_config is not None:
            model_kwargs["distributed_config"] = dist_config
        return _from_disk(model_dir, device, torch_dtype, model_kwargs)

    t_attach = time.perf_counter()
    try:
        meta = read_side_data(att, META_NAME, META_FORMAT, "transformers",
                              f"the daemon at {sock} holds raw checkpoint "
                              "tensors, not the model transformers' from_pretrained built: restart it with "
                              "`weightcache preload --engine transformers` from this weightcache version")
        model, seconds = build(model_dir, att.tensors, att.roles, meta, device=device, dtype=torch_dtype,
                               distributed_config=dist_config, hf_kwargs=model_kwargs)
    except BaseException:
        att.close()
        raise
    model.__dict__["_weightcache_attachment"] = att
    model.__dict__["_weightcache_source"] = "attach"
    model.__dict__["_weightcache_timings"] = {"key": t_key - t0, "attach": t_attach - t_key, **seconds}
    log.info("attached %s from %s (%d tensors, %.2f GiB)", model_dir, att.key.model, len(att), att.nbytes / 2**30)
    return model


__all__ = ["NoDaemonWarning", "build", "engine_version", "from_pretrained", "key_for_checkpoint", "resolve_dtype",
           "snapshot_revision"]
