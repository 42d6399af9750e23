"""transformers engine: ``from_pretrained`` over weights a daemon holds.

``weightcache.transformers.from_pretrained(path, device=..., dtype=...)`` returns the model that
``AutoModelForCausalLM.from_pretrained`` would build, without reading the checkpoint's weight files when a
daemon holds them: the model is built on the meta device from its config (as transformers itself does),
the daemon's tensors are bound in place (zero-copy with ``mode="map"``), tied weights stay tied, and the
non-persistent buffers (rotary ``inv_freq``) are recomputed by the model's own ``_init_weights`` on the
target device, as ``from_pretrained`` does.

``key_for_checkpoint`` is the cache identity of a checkpoint served for this engine; ``weightcache preload``
(engine "transformers") computes its key with the same function, so both sides agree.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.metadata
import json
import logging
import re
import struct
import time
import warnings
from pathlib import Path

import torch

from ..client import attach, find_socket
from ..errors import DaemonNotReady, DaemonUnavailable, KeyMismatch, PermissionDenied, WeightCacheError
from ..key import CacheKey, checkpoint_digest, config_digest, dtype_name, parse_dtype
from ..naming import default_socket_dir, device_tag, socket_path
from .torch import BindError, bind

log = logging.getLogger("weightcache.engines.transformers")

ENGINE = "transformers"
_SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")
_ST_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class NoDaemonWarning(UserWarning):
    """from_pretrained fell back to reading the checkpoint from disk."""


# ---- identity -------------------------------------------------------------------------------------------------


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} has no config.json: not a transformers checkpoint directory") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def _checkpoint_float_dtype(model_dir: Path) -> torch.dtype | None:
    """What transformers' dtype="auto" falls back to without a config dtype: the index's metadata, else
    the first floating-point tensor of the first weight file (its header only)."""
    index = model_dir / "model.safetensors.index.json"
    files = [model_dir / "model.safetensors"]
    if index.exists():
        meta = json.loads(index.read_text())
        if isinstance(meta.get("metadata"), dict) and meta["metadata"].get("dtype"):
            return parse_dtype(str(meta["metadata"]["dtype"]))
        files = [model_dir / f for f in sorted(set(meta.get("weight_map", {}).values()))]
    for f in files[:1]:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 100 << 20)))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in _ST_FLOATS:
                return _ST_FLOATS[entry["dtype"]]
    return None


def resolve_dtype(model_dir: str | Path, dtype=None, *, config: dict | None = None) -> torch.dtype:
    """The dtype ``from_pretrained`` loads with: an explicit dtype, else ("auto"/None) the config's
    ``dtype``/``torch_dtype``, else the checkpoint's floating-point dtype, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None and not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype, a dtype name or 'auto', not {type(dtype).__name__}")
    if dtype not in (None, "auto"):
        try:
            return parse_dtype(dtype)
        except ValueError:
            raise ValueError(f"unknown dtype {dtype!r}: use 'auto' or a torch dtype name such as 'bfloat16'") from None
    model_dir = Path(model_dir)
    cfg = config if config is not None else _read_config(model_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and name != "auto":
        return parse_dtype(name)
    return _checkpoint_float_dtype(model_dir) or torch.float32


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


def key_for_checkpoint(
    model_dir: str | Path,
    *,
    dtype=None,
    layout: str = "dp1-pp1-tp1",
    rank: int = 0,
    role: str = "main",
    engine: str = ENGINE,
    revision: str | None = None,
) -> CacheKey:
    """The CacheKey of a checkpoint directory served for ``engine``: the checkpoint's content digest, the
    resolved dtype (``dtype=None``/"auto" as transformers resolves it), its quantization config, the parallel
    layout, rank and role. Reads config.json and stats the weight files (their digests are remembered);
    never reads weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {model_dir}")
    cfg = _read_config(model_dir)
    return CacheKey(
        model=str(model_dir.resolve()),
        content_digest=checkpoint_digest(model_dir),
        revision=snapshot_revision(model_dir) if revision is None else revision,
        dtype=dtype_name(resolve_dtype(model_dir, dtype, config=cfg)),
        quantization=config_digest(cfg.get("quantization_config")),
        layout=layout,
        rank=rank,
        role=role,
        engine=engine,
        engine_version=engine_version() if engine == ENGINE else "",
    )


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


def _hf_major() -> int:
    try:
        return int(engine_version().split(".")[0])
    except ValueError:
        return 5


def _skip_init():
    """transformers' own switch that turns torch's init functions and ``init_weights`` into no-ops, as its
    loaders do (transformers >= 5); elsewhere a no-op context."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _build_meta_model(config, dtype: torch.dtype, model_kwargs: dict):
    from transformers import AutoModelForCausalLM

    kwargs = dict(model_kwargs)
    kwargs["dtype" if _hf_major() >= 5 else "torch_dtype"] = dtype
    with torch.device("meta"):
        with _skip_init():  # random init of meta tensors is wasted work (decomposed uniform_ per Linear)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        model.init_weights()  # on meta this only ties weights, as post_init would have
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:  # keep-in-fp32 modules: transformers loads them in their own dtype
        pattern = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in plan))
        targets = list(plan.items())
        for name, p in model.named_parameters():
            if pattern.search(name):
                want = next(dt for pat, dt in targets if re.search(pat.replace("*", ".*"), name))
                p.data = torch.empty(p.shape, dtype=want, device="meta")
    return model


def _renamed(model, tensors) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the model's names through transformers' own renamings (legacy names,
    base-model prefix); fused conversions (e.g. stacked MoE experts) are refused."""
    expected = set(model.state_dict(keep_vars=True))
    if all(n in expected for n in tensors):
        return dict(tensors)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return dict(tensors)
    transforms = get_model_conversion_mapping(model, None, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_sd = model.state_dict(keep_vars=True)
    out = {}
    for name, t in tensors.items():
        if name in expected:
            out[name] = t
            continue
        new, conv = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_sd)
        if conv is not None:
            raise BindError(
                f"{name}: the model needs transformers' weight conversion {conv!r} (tensors fused at load "
                "time); attaching such checkpoints is not supported, load it from disk (fallback=True)"
            )
        out[new if new not in out else name] = t
    return out


def _generation_config(model, model_dir: Path, trust_remote_code: bool) -> None:
    """The generation defaults from_pretrained reads (generation_config.json, else the model config)."""
    if not model.can_generate():
        return
    try:
        model.adjust_generation_fn(
            None, True, None, str(model_dir), cache_dir=None, force_download=False, proxies=None,
            local_files_only=True, token=None, revision="main", subfolder="", trust_remote_code=trust_remote_code,
        )
    except TypeError:  # another transformers signature
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
        except OSError:
            pass


def _from_disk(path, device: torch.device, dtype: torch.dtype, hf_kwargs: dict):
    from transformers import AutoModelForCausalLM

    kwargs = dict(hf_kwargs)
    kwargs["dtype" if _hf_major() >= 5 else "torch_dtype"] = dtype
    if device.type == "cpu":
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    else:
        try:  # straight onto the device (needs accelerate in some transformers versions)
            model = AutoModelForCausalLM.from_pretrained(str(path), device_map={"": str(device)}, **kwargs)
        except ValueError as e:
            if "accelerate" not in str(e):
                raise
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device)
    model.__dict__["_weightcache_source"] = "disk"
    return model


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
    revision: str | None = None,
    layout: str = "dp1-pp1-tp1",
    rank: int = 0,
    role: str = "main",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    **hf_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` on ``device``, with the weights taken from
    the weight cache daemon that holds this checkpoint (``weightcache preload --model PATH``).

    ``device``: the daemon's device (default: the current CUDA device, else cpu). ``dtype``: as transformers
    ("auto" by default). ``socket_dir``: where daemons live (default: the per-user directory).
    ``fallback``: without a daemon for this checkpoint (none, another version, not ready within ``wait``
    seconds, failed) load from disk with a warning; ``fallback=False`` raises instead. ``mode="map"`` binds
    the daemon's memory zero-copy and read-only (an engine that writes weights needs ``mode="copy"``).
    The model keeps the attachment (``model._weightcache_attachment``); ``model._weightcache_source`` is
    "attach" or "disk"."""
    if mode not in ("map", "copy"):
        raise ValueError(f"mode must be 'map' or 'copy', not {mode!r}")
    sizes = dict(re.findall(r"(dp|pp|tp)(\d+)", layout))
    if int(sizes.get("tp", 1)) > 1 or int(sizes.get("pp", 1)) > 1:
        raise WeightCacheError(
            f"layout {layout}: from_pretrained binds whole models (pp1, tp1; any dp); a tensor- or pipeline-"
            "parallel engine takes its rank's shards with weightcache.load_into on its own sharded module"
        )
    t0 = time.perf_counter()
    model_dir = _local_dir(path, revision)
    device = _resolve_device(device)
    cfg_json = _read_config(model_dir)
    torch_dtype = resolve_dtype(model_dir, dtype, config=cfg_json)
    model_kwargs = {}
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    if trust_remote_code:
        model_kwargs["trust_remote_code"] = True
    disk_kwargs = {**hf_kwargs, **model_kwargs}
    if revision is not None:
        disk_kwargs["revision"] = revision

    sdir = Path(socket_dir) if socket_dir is not None else default_socket_dir()
    key = key_for_checkpoint(model_dir, dtype=torch_dtype, layout=layout, rank=rank, role=role, revision=revision)
    tag = device_tag(device)
    t_key = time.perf_counter()
    wanted = socket_path(sdir, key, tag)
    if cfg_json.get("quantization_config"):
        problem: Exception | None = WeightCacheError(
            f"{model_dir} is quantized ({cfg_json['quantization_config'].get('quant_method', '?')}); the transformers "
            "engine attaches unquantized checkpoints only"
        )
    else:
        problem = None
        try:
            sock = find_socket(sdir, key, tag)
            att = attach(sock, expect=key, mode=mode, readonly=readonly, wait=wait, timeout=timeout)
        except DaemonUnavailable as e:
            problem = DaemonUnavailable(
                f"no weight cache daemon holds {model_dir} ({key.dtype}, {layout} rank {rank}) for {device}: tried "
                f"{wanted} ({e}); start one with `weightcache preload --model {model_dir} --dtype {key.dtype} "
                f"--weight-cache-socket-dir {sdir}`"
            )
        except (KeyMismatch, DaemonNotReady, PermissionDenied) as e:
            problem = e
    if problem is not None:
        if not fallback:
            raise problem
        warnings.warn(f"weightcache: loading {model_dir} from disk: {problem}", NoDaemonWarning, stacklevel=2)
        return _from_disk(model_dir, device, torch_dtype, disk_kwargs)

    t_attach = time.perf_counter()
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        config.name_or_path = str(path)
        model = _build_meta_model(copy.deepcopy(config), torch_dtype, model_kwargs)
        t_build = time.perf_counter()
        bind(model, _renamed(model, att), roles=att.roles, device=att.device, strict=True,
             ignore_unexpected=list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []))
        _generation_config(model, model_dir, trust_remote_code)
        model.eval()
    except BaseException:
        att.close()
        raise
    model.__dict__["_weightcache_attachment"] = att
    model.__dict__["_weightcache_source"] = "attach"
    t_end = time.perf_counter()
    model.__dict__["_weightcache_timings"] = {"key": t_key - t0, "attach": t_attach - t_key,
                                              "build": t_build - t_attach, "bind": t_end - t_build}
    log.info("attached %s from %s (%d tensors, %.2f GiB)", model_dir, att.key.model, len(att), att.nbytes / 2**30)
    return model


__all__ = ["NoDaemonWarning", "engine_version", "from_pretrained", "key_for_checkpoint", "resolve_dtype",
           "snapshot_revision"]
