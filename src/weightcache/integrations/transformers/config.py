"""What a transformers checkpoint's own files say, without torch or transformers: its config.json and the dtype
``from_pretrained`` loads it with (by name). The preload's front end decides with these before any daemon starts,
so it imports neither."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ...dtypes import FLOAT_CODES, SAFETENSORS, known_name


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} has no config.json: not a transformers checkpoint directory") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a model config (a JSON {type(cfg).__name__}, not an object)")
    return cfg


def checkpoint_float_dtype_name(model_dir: Path) -> str | None:
    """What transformers' dtype="auto" falls back to without a config dtype: the index's metadata, else the first
    floating-point tensor of the first weight file (its header only)."""
    index = model_dir / "model.safetensors.index.json"
    files = [model_dir / "model.safetensors"]
    if index.exists():
        meta = json.loads(index.read_text())
        if isinstance(meta.get("metadata"), dict) and meta["metadata"].get("dtype"):
            return known_name(str(meta["metadata"]["dtype"]))
        files = [model_dir / f for f in sorted(set(meta.get("weight_map", {}).values()))]
    for f in files[:1]:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 100 << 20)))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in FLOAT_CODES:
                return SAFETENSORS[entry["dtype"]][0]
    return None


def resolve_dtype_name(model_dir: str | Path, dtype: str | None = None, *, config: dict | None = None) -> str:
    """The name of the dtype ``from_pretrained`` loads with: an explicit one, else ("auto"/None) the config's
    ``dtype``/``torch_dtype``, else the checkpoint's floating-point dtype, else float32. ValueError for a name
    torch does not have."""
    if dtype not in (None, "auto"):
        try:
            return known_name(dtype)
        except ValueError:
            raise ValueError(f"unknown dtype {dtype!r}: use 'auto' or a torch dtype name such as 'bfloat16'") from None
    model_dir = Path(model_dir)
    cfg = config if config is not None else read_config(model_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and name != "auto":
        return known_name(name)
    return checkpoint_float_dtype_name(model_dir) or "float32"


def modeling_module(model_type) -> str | None:
    """The module of transformers' model classes for a config's ``model_type`` (None for no such name)."""
    if isinstance(model_type, str) and model_type.isidentifier():
        return f"transformers.models.{model_type}.modeling_{model_type}"
    return None


def model_modules(path: str | Path) -> tuple[str, ...]:
    """What transformers' from_pretrained imports to build this model (its model class's module included)."""
    mods = ["transformers.modeling_utils", "transformers.models.auto.modeling_auto"]
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    own = modeling_module(model_type)
    return tuple(mods + [own] if own else mods)
