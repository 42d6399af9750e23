"""Tensor-parallel plans: which checkpoint tensor is split along which dim for a TP rank.

Plans are transformers' own (``model.tp_plan``: the class ``_tp_plan`` plus ``config.base_model_tp_plan``
under the base-model prefix), matched the way transformers matches them: layer numbers become ``*`` and a
parameter falls back to its module's rule. Style semantics follow ``transformers.distributed.tensor_parallel``:

* ``colwise`` (and ``colwise_rep``, ``colwise_gather_output``, ``local_colwise``): weight dim ``ndim - 2``
  (dim 0 of a Linear), 1-D tensors (bias) dim 0; an ``nn.Embedding`` weight dim 1.
* ``rowwise`` (and ``rowwise_rep``, ``rowwise_split_input``, ``local_rowwise``): weight dim -1, bias
  replicated; an ``nn.Embedding`` weight dim 0 (``embedding_rowwise``: vocab-parallel embedding).
* ``packed_colwise`` / ``packed_rowwise``: fused (e.g. gate|up) weights, split per packed part
  (``_StridedShard`` with split factor 2) so each rank gets its slice of every part.
* ``grouped_gemm``: dim 0 (the expert dim).
* anything else (``sequence_parallel``, ``replicated_with_grad_allreduce``, ...) and tensors no rule
  matches: replicated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import WeightCacheError

log = logging.getLogger(__name__)

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise", "embedding_rowwise")
PACKED_COLWISE = ("packed_colwise", "local_packed_colwise")
PACKED_ROWWISE = ("packed_rowwise", "local_packed_rowwise")
EXPERT_DIM = ("grouped_gemm",)
REPLICATED = (
    "replicate",
    "replicated",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "all_reduce",
    "mla_kv_a_proj",
    "moe_tp_experts",
    "moe_identity_expert",
    "ep_router",
    "ep_dispatch_experts",
    "megamoe_router",
    "megamoe_experts",
    "gather",
    "isolated",
    "local",
)
KNOWN_STYLES = COLWISE + ROWWISE + PACKED_COLWISE + PACKED_ROWWISE + EXPERT_DIM + REPLICATED
PACKED_SPLIT = 2  # transformers' PackedColwiseParallel / PackedRowwiseParallel default split factor

_EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "embeddings", "tok_embeddings")


class TPPlanError(WeightCacheError, ValueError):
    """A tensor-parallel plan that cannot be applied to a checkpoint."""


@functools.cache
def _wildcard_of():
    """transformers' own name generalisation (public in transformers.distributed.tensor_parallel), imported on
    first use: checking a TP size needs no transformers."""
    try:
        from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard
    except Exception:  # pragma: no cover - older/newer transformers or none at all
        try:
            from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard
        except Exception:

            def replace_layer_number_by_wildcard(name: str) -> str:
                return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    return replace_layer_number_by_wildcard


def replace_layer_number_by_wildcard(name: str) -> str:
    return _wildcard_of()(name)


@dataclass(frozen=True)
class ShardSpec:
    """How one tensor is split: along ``dim`` into ``tp_size`` parts; ``split > 1`` for packed tensors."""

    style: str | None
    dim: int | None  # None: replicated
    split: int = 1

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def check(self, name: str, shape: tuple[int, ...], tp_size: int) -> None:
        if self.dim is None or tp_size == 1:
            return
        size = shape[self.dim]
        if size % (tp_size * self.split):
            parts = f"{self.split} packed parts x {tp_size} ranks" if self.split > 1 else f"{tp_size} ranks"
            raise TPPlanError(
                f"{name}: dim {self.dim} (size {size}) of shape {list(shape)} does not divide into {parts} "
                f"(plan style {self.style!r}); choose a tensor parallel size that divides it, or override "
                f"this tensor's rule with a tp_plan entry (e.g. 'replicate')"
            )

    def shard_shape(self, shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] //= tp_size
        return tuple(out)

    def ranges(self, shape: tuple[int, ...], tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
        """[start, stop) ranges along ``dim`` that make up this rank's shard, in order."""
        if self.dim is None:
            return [(0, shape[0] if shape else 0)]
        part = shape[self.dim] // self.split
        step = part // tp_size
        return [(p * part + tp_rank * step, p * part + (tp_rank + 1) * step) for p in range(self.split)]


def spec_for_style(style: str | None, name: str, ndim: int, embedding: bool = False) -> ShardSpec:
    """Shard rule of one parameter under a transformers TP style (see the module docstring)."""
    if style is None or ndim == 0:
        return ShardSpec(style, None)
    leaf = name.rsplit(".", 1)[-1]
    if style in COLWISE:
        if embedding and ndim >= 2:
            return ShardSpec(style, 1)
        return ShardSpec(style, max(ndim - 2, 0))
    if style in ROWWISE:
        if (embedding or style == "embedding_rowwise") and ndim >= 2:
            return ShardSpec(style, 0)
        if leaf == "bias":
            return ShardSpec(style, None)
        return ShardSpec(style, ndim - 1)
    if style in PACKED_COLWISE:
        if ndim == 1:
            return ShardSpec(style, 0)
        return ShardSpec(style, ndim - 2, PACKED_SPLIT)
    if style in PACKED_ROWWISE:
        if ndim == 1:
            return ShardSpec(style, None)
        return ShardSpec(style, ndim - 1, PACKED_SPLIT)
    if style in EXPERT_DIM:
        return ShardSpec(style, 0)
    if style in REPLICATED:
        return ShardSpec(style, None)
    raise TPPlanError(f"{name}: unknown tensor parallel style {style!r}; known styles: {sorted(KNOWN_STYLES)}")


class TPPlan:
    """A plan (pattern -> style) plus which modules are embeddings, matched like transformers does."""

    def __init__(
        self,
        plan: Mapping[str, str] | None = None,
        *,
        prefix: str = "model",
        embeddings: set[str] | None = None,
        source: str = "user",
    ):
        plan = dict(plan or {})
        for k, v in plan.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TPPlanError(f"tp_plan entries must map str to str, got {k!r}: {v!r}")
            if v not in KNOWN_STYLES:
                raise TPPlanError(f"tp_plan[{k!r}]: unknown style {v!r}; known styles: {sorted(KNOWN_STYLES)}")
        self.plan = plan
        self.prefix = prefix
        self.embeddings = set(embeddings) if embeddings is not None else None
        self.source = source

    def __repr__(self) -> str:
        return f"TPPlan({self.source}, {len(self.plan)} rules, prefix={self.prefix!r})"

    def _lookup(self, generic: str) -> str | None:
        if generic in self.plan:
            return self.plan[generic]
        if "." in generic and (module := generic.rsplit(".", 1)[0]) in self.plan:
            return self.plan[module]
        return None

    def style(self, name: str) -> str | None:
        """The style of a checkpoint tensor name, or None (replicated)."""
        generic = replace_layer_number_by_wildcard(name)
        style = self._lookup(generic)
        if style is None and self.prefix and generic.startswith(self.prefix + "."):
            style = self._lookup(generic[len(self.prefix) + 1 :])  # base-model-relative rules
        return style

    def is_embedding(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0] if "." in name else name
        if self.embeddings is not None:
            return module in self.embeddings
        return module.rsplit(".", 1)[-1] in _EMBEDDING_NAMES

    def spec(self, name: str, shape: tuple[int, ...]) -> ShardSpec:
        return spec_for_style(self.style(name), name, len(shape), self.is_embedding(name))

    # -- from transformers -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TPPlan:
        """The plan transformers would use for the checkpoint's architecture (empty without a config)."""
        model_dir = Path(model_dir)
        cfg = model_dir / "config.json" if model_dir.is_dir() else None
        if cfg is None or not cfg.is_file():
            return cls({}, source="none (no config.json)")
        try:
            from transformers import AutoConfig
        except ImportError:
            return cls._from_config_json(cfg)
        try:
            config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:  # unknown model_type: fall back to the raw JSON
            log.debug("AutoConfig failed for %s (%s); reading base_model_tp_plan from config.json", model_dir, e)
            return cls._from_config_json(cfg)
        return cls.from_config(config)

    @classmethod
    def _from_config_json(cls, path: Path) -> TPPlan:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TPPlanError(f"cannot read {path}: {e}") from e
        if not isinstance(raw, dict):
            raise TPPlanError(f"{path}: not a model config (a JSON {type(raw).__name__}, not an object)")
        base = raw.get("base_model_tp_plan") or {}
        return cls(base, prefix="model", source=f"{path} base_model_tp_plan")

    @classmethod
    def from_config(cls, config) -> TPPlan:
        """Build the model on the meta device and take ``model.tp_plan`` and its embedding modules."""
        import torch

        model_cls = _model_class(config)
        if model_cls is not None:
            try:
                with torch.device("meta"), _no_init_weights():
                    model = model_cls(config)
                embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
                plan = {k: v for k, v in dict(model.tp_plan).items()}
                return cls(
                    _known_only(plan, model_cls.__name__),
                    prefix=getattr(model, "base_model_prefix", "") or "",
                    embeddings=embeddings,
                    source=f"transformers {model_cls.__name__}.tp_plan",
                )
            except Exception as e:
                log.debug("meta construction of %s failed (%s); using config.base_model_tp_plan", model_cls, e)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model_cls, "base_model_prefix", "model") if model_cls else "model"
        plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
        plan.update(dict(getattr(model_cls, "_tp_plan", None) or {}))
        return cls(_known_only(plan, type(config).__name__), prefix=prefix, source="config.base_model_tp_plan")


def _no_init_weights():
    """transformers' own switch that skips initializing weights (a meta model needs none: half the time of
    building a 16 GB Llama's skeleton); nothing where this transformers has none."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(where).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _known_only(plan: dict[str, str], where: str) -> dict[str, str]:
    unknown = {k: v for k, v in plan.items() if v not in KNOWN_STYLES}
    if unknown:
        log.warning("%s: tensor parallel styles %s are not known to weightcache; replicating", where, unknown)
    return {k: v for k, v in plan.items() if v in KNOWN_STYLES}


def _model_class(config):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModel"):
        mapping = getattr(transformers, auto, None)
        try:
            return mapping._model_mapping[type(config)]
        except Exception:
            continue
    return None


def check_tp_size(config: Mapping, tp_size: int) -> None:
    """transformers' plans split attention by heads (query and key/value), the MLP by its intermediate size and
    the output projection by the vocabulary: each must divide by the TP size. Refuses, naming what does not and
    the sizes that would work, before any rank loads."""
    if tp_size <= 1:
        return
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    heads = cfg.get("num_attention_heads")
    sizes = {
        "attention heads": heads,
        "key/value heads": cfg.get("num_key_value_heads") or heads,
        "intermediate size": cfg.get("intermediate_size"),
        "vocabulary size": cfg.get("vocab_size"),
    }
    sizes = {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if not bad:
        return
    what = ", ".join(f"{v} {k}" for k, v in bad.items())
    common = math.gcd(*sizes.values())
    fits = [n for n in range(1, common + 1) if common % n == 0]
    larger = " is larger than" if all(v < tp_size for v in bad.values()) else " does not divide"
    raise TPPlanError(f"tensor parallel size {tp_size}{larger} the model's {what}; transformers' plan splits "
                      f"each over the ranks: use one of {', '.join(map(str, fits[:12]))}")


def resolve_plan(model_dir: str | Path, tp_plan: Mapping[str, str] | TPPlan | str | None = None) -> TPPlan:
    """``tp_plan`` may be a TPPlan, a dict (pattern -> style), "auto"/None (transformers' plan for the
    checkpoint) or "none" (replicate everything)."""
    if isinstance(tp_plan, TPPlan):
        return tp_plan
    if tp_plan is None or tp_plan == "auto":
        return TPPlan.from_pretrained(model_dir)
    if tp_plan == "none":
        return TPPlan({}, source="none")
    if isinstance(tp_plan, Mapping):
        auto = TPPlan.from_pretrained(model_dir)
        return TPPlan(tp_plan, prefix=auto.prefix, embeddings=auto.embeddings, source="user")
    raise TPPlanError(f"tp_plan must be a dict, a TPPlan, 'auto' or 'none', got {tp_plan!r}")
