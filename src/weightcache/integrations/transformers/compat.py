"""What the transformers daemon and the transformers engine share: the cache identity of a checkpoint, the
rules for walking a transformers model, and a switch inside transformers' own ``from_pretrained``.

``from_pretrained`` builds the model on the meta device (config, quantizer module replacement, keep-in-fp32
plan, weight conversion mapping, tensor parallel plan), then calls ``_load_pretrained_model`` (reads the
checkpoint, converts and renames tensors, quantizes) and ``_finalize_model_loading`` (ties weights,
initialises what the checkpoint lacks and the non-persistent buffers), then runs the quantizer's
post-processing and loads the generation config. :func:`intercept_loading` lets this process observe
(the daemon) or replace (the engine) those two loading steps for one call, leaving everything else as
transformers does it; other threads and calls are untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import re
from pathlib import Path

import torch

from ...digests import checkpoint_digest, config_digest
from ...dtypes import dtype_name, parse_dtype
from ...errors import WeightCacheError
from ...key import CacheKey
from ..model_state import Rules, walkable_in
from .config import read_config, resolve_dtype_name

ENGINE = "transformers"
LOADER = "from_pretrained"  # key extra: the weights are what transformers' own loader built
META_NAME = "__weightcache__.transformers"  # JSON side data (aliases, Python state) as a uint8 tensor
META_FORMAT = 1
# Plain transformers objects (not modules, configs or tensors) whose attributes may hold tensors.
# ``_weight_conversions``: the conversions that matched the checkpoint (kept for saving); the engine sets them
# from the side data.
RULES = Rules(walkable=walkable_in("transformers", exclude_suffixes=("Config", "Quantizer")),
              engine_made=frozenset({"_weight_conversions"}))

_SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")

class UnsupportedModel(WeightCacheError, ValueError):
    """A model whose loaded state the cache cannot carry faithfully (named in the message)."""


# ---- identity -------------------------------------------------------------------------------------------------


def resolve_dtype(model_dir: str | Path, dtype=None, *, config: dict | None = None) -> torch.dtype:
    """The dtype ``from_pretrained`` loads with (``config.resolve_dtype_name``); a torch.dtype is kept."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None and not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype, a dtype name or 'auto', not {type(dtype).__name__}")
    return parse_dtype(resolve_dtype_name(model_dir, dtype, config=config))


def snapshot_revision(model_dir: str | Path) -> str:
    """The commit of a Hugging Face cache snapshot directory (``.../snapshots/<sha>``), else ""."""
    p = Path(model_dir).absolute()
    return p.name if p.parent.name == "snapshots" and _SNAPSHOT.match(p.name) else ""


@functools.cache
def engine_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return ""


def major_version() -> int:
    try:
        return int(engine_version().split(".")[0])
    except ValueError:
        return 5


def quantization_field(model_dir: Path, cfg: dict, device: str | torch.device | None) -> str:
    """'none', or the digest of the quantization config transformers will load with on ``device``: the
    checkpoint's, as the quantizer settles it for this machine (e.g. FP8 is dequantized where there is no
    FP8-capable GPU). Reads config.json only."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "none"
    if device is None:
        return config_digest(qc)
    effective = effective_quantization_config(model_dir, device)
    return config_digest(effective if effective is not None else qc)


def effective_quantization_config(model_dir: Path, device) -> dict | None:
    """The quantization config after transformers' quantizer has validated the environment for ``device``
    (what ``from_pretrained`` loads with), or None when transformers does not quantize this checkpoint."""
    from transformers import AutoConfig
    from transformers.quantizers.auto import get_hf_quantizer

    config = AutoConfig.from_pretrained(str(model_dir))
    try:
        quantizer, _, _ = get_hf_quantizer(config, None, device_map_for(torch.device(device)), True, {})
    except (ImportError, RuntimeError, ValueError) as e:
        raise UnsupportedModel(f"{model_dir}: transformers cannot load this quantized checkpoint here: {e}") from None
    return quantizer.quantization_config.to_dict() if quantizer is not None else None


def key_for_checkpoint(
    model_dir: str | Path,
    *,
    dtype=None,
    layout: str = "dp1-pp1-tp1",
    rank: int = 0,
    role: str = "main",
    engine: str = ENGINE,
    revision: str | None = None,
    device: str | torch.device | None = None,
    loader: str | None = LOADER,
    experts_implementation: str | None = None,
) -> CacheKey:
    """The CacheKey of a checkpoint directory served for ``engine``: the checkpoint's content digest, the
    resolved dtype (``dtype=None``/"auto" as transformers resolves it), its quantization config (as the
    quantizer settles it on ``device``), the parallel layout, rank and role, and (``loader``) that the
    weights are what transformers' own loader built. Reads config.json and stats the weight files (their
    digests are remembered); never reads weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {model_dir}")
    cfg = read_config(model_dir)
    extra = {}
    if loader:
        extra["loader"] = loader
    if experts_implementation:  # an experts kernel may want its own weight layout
        extra["experts_implementation"] = experts_implementation
    return CacheKey(
        model=str(model_dir.resolve()),
        content_digest=checkpoint_digest(model_dir),
        revision=snapshot_revision(model_dir) if revision is None else revision,
        dtype=dtype_name(resolve_dtype(model_dir, dtype, config=cfg)),
        quantization=quantization_field(model_dir, cfg, device),
        layout=layout,
        rank=rank,
        role=role,
        engine=engine,
        engine_version=engine_version() if engine == ENGINE else "",
        extra=extra,
    )


def device_map_for(device: torch.device):
    """What ``from_pretrained`` is given for one device: nothing on the CPU (its default), else the device."""
    return None if device.type == "cpu" else {"": device}


# ---- the switch inside from_pretrained ------------------------------------------------------------------------


class LoadingSteps:
    """Replaces or observes ``_load_pretrained_model`` and ``_finalize_model_loading`` for one call of
    ``from_pretrained`` (see :func:`intercept_loading`). Subclasses override what they change; the
    defaults run transformers' own steps."""

    def load(self, original, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        return original(model, state_dict, checkpoint_files, load_config, expected_keys)

    def finalize(self, original, model, load_config, loading_info):
        return original(model, load_config, loading_info)


_ACTIVE: contextvars.ContextVar[LoadingSteps | None] = contextvars.ContextVar("weightcache_loading", default=None)
_INSTALLED = False


def _install() -> None:
    """Route ``PreTrainedModel``'s two loading steps through the active :class:`LoadingSteps` (once; with none
    active they are transformers' own)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers.modeling_utils import PreTrainedModel

    load = PreTrainedModel.__dict__.get("_load_pretrained_model")
    finalize = PreTrainedModel.__dict__.get("_finalize_model_loading")
    if not isinstance(load, staticmethod) or not isinstance(finalize, staticmethod):
        raise UnsupportedModel(f"transformers {engine_version()} has no _load_pretrained_model / "
                               "_finalize_model_loading steps to capture; this version is not supported")
    load_fn, finalize_fn = load.__func__, finalize.__func__

    @functools.wraps(load_fn)
    def routed_load(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        steps = _ACTIVE.get()
        if steps is None:
            return load_fn(model, state_dict, checkpoint_files, load_config, expected_keys)
        return steps.load(load_fn, model, state_dict, checkpoint_files, load_config, expected_keys)

    @functools.wraps(finalize_fn)
    def routed_finalize(model, load_config, loading_info):
        steps = _ACTIVE.get()
        if steps is None:
            return finalize_fn(model, load_config, loading_info)
        return steps.finalize(finalize_fn, model, load_config, loading_info)

    PreTrainedModel._load_pretrained_model = staticmethod(routed_load)
    PreTrainedModel._finalize_model_loading = staticmethod(routed_finalize)
    _INSTALLED = True


@contextlib.contextmanager
def intercept_loading(steps: LoadingSteps):
    """Within the block, ``from_pretrained`` calls in this thread (or task) go through ``steps``."""
    _install()
    token = _ACTIVE.set(steps)
    try:
        yield steps
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def skip_init_on_meta():
    """torch's init functions return at once for meta tensors (there is nothing to fill; transformers builds the
    model on the meta device and still runs each ``nn.Linear``'s random init on it); real tensors are
    initialised as usual, so other threads and anything built off the meta device are unaffected."""
    import sys

    try:
        from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH
    except ImportError:
        TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH = {}, ()
    saved = []
    for module_name in TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(module_name)
        for fname in TORCH_INIT_FUNCTIONS:
            fn = getattr(module, fname, None) if module is not None else None
            if fn is None or getattr(fn, "_weightcache_meta_skip", False):
                continue

            def skipping(tensor, *args, _fn=fn, **kwargs):
                return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else _fn(tensor, *args, **kwargs)

            skipping._weightcache_meta_skip = True
            saved.append((module, fname, fn))
            setattr(module, fname, skipping)
    try:
        yield
    finally:
        for module, fname, fn in reversed(saved):
            setattr(module, fname, fn)


def load_kwargs(*, dtype: torch.dtype, device: torch.device, attn_implementation: str | None = None,
                experts_implementation: str | None = None, trust_remote_code: bool = False,
                revision: str | None = None, distributed_config=None, extra: dict | None = None) -> dict:
    """The keyword arguments both sides give ``from_pretrained`` (so both build the same model)."""
    kw = dict(extra or {})
    kw["dtype" if major_version() >= 5 else "torch_dtype"] = dtype
    if distributed_config is not None:
        kw["distributed_config"] = distributed_config
    else:
        dm = device_map_for(device)
        if dm is not None:
            kw["device_map"] = dm
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    if trust_remote_code:
        kw["trust_remote_code"] = True
    if revision:
        kw["revision"] = revision
    kw.setdefault("local_files_only", True)
    return kw


def unwrap_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


__all__ = ["ENGINE", "LOADER", "META_FORMAT", "META_NAME", "RULES", "LoadingSteps", "UnsupportedModel",
           "device_map_for", "effective_quantization_config", "engine_version", "intercept_loading",
           "key_for_checkpoint", "load_kwargs", "read_config", "resolve_dtype", "snapshot_revision",
           "unwrap_local"]
