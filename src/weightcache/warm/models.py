"""The modules an engine imports for one model's architecture (vLLM's model file, transformers' modeling file):
the warm interpreter imports them too when it is told the model (`warm-engine --model DIR`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _config(model_dir: str | Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def model_modules(model_dir: str | Path) -> list[str]:
    """Module names for the model in `model_dir`, for the engines already imported here; [] when unknown."""
    config = _config(model_dir)
    configs = [config] + [c for c in (config.get("text_config"),) if isinstance(c, dict)]
    names: list[str] = []
    if "vllm" in sys.modules:
        from vllm.model_executor.models.registry import ModelRegistry

        for arch in (a for c in configs for a in c.get("architectures") or ()):
            name = getattr(ModelRegistry.models.get(arch), "module_name", None)
            if name:
                names.append(name)
    if "transformers" in sys.modules:
        from ..integrations.transformers.config import modeling_module

        for c in configs:
            name = modeling_module(str(c.get("model_type") or "").replace("-", "_"))
            if name:
                names.append(name)
    return list(dict.fromkeys(names))
