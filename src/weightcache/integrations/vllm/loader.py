"""``--load-format weightcache``: a vLLM model loader that attaches a rank's weights from its daemon.

The model is built on the meta device (no checkpoint read); the daemon's tensors are bound in place of
every parameter, buffer and tensor attribute (parameters keep their class and attributes, e.g.
``weight_loader``), the host-side scalars its loading set are set, and what it deleted is deleted. Weight
post-processing is not run again. What is made here cannot cross a process: the kernel objects post-processing
built from the processed weights (MoE kernels, Machete's activation permutation; no tensor is transformed),
private copies of the scratch tensors kernels write (Marlin's workspace), and on vLLM's CPU backend the GEMM
kernel handles made from each unquantized weight (as vLLM's post-processing makes them).

Options (``--model-loader-extra-config '{...}'``):

- ``socket_dir``: where the daemons' sockets are (default: the per-user socket directory)
- ``mode``: ``map`` (default; zero-copy, read-only) or ``copy`` (private writable copy, e.g. for in-place
  weight reloads)
- ``fallback``: ``true`` to load from disk with a warning when no daemon serves this key (default ``false``:
  fail with a message naming the socket tried)
- ``wait``: seconds to wait while the daemon reports ``loading`` (default 600)
- ``verify``: ``true`` to re-hash the attached weights on this device against the digests the daemon recorded
  at load before binding them; a mismatch fails the load naming the tensors, or with ``fallback`` loads from
  disk (default ``false``)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ...errors import DaemonNotReady, DaemonUnavailable, KeyMismatch, WeightCacheError
from ...integrity import IntegrityError
from .. import model_state
from ..model_state import apply_deletions, apply_scalars, bind_captured

# Under "vllm" so that vLLM's logging configuration (handler, format, level) shows these lines.
log = logging.getLogger("vllm.weightcache")

LOAD_FORMAT = "weightcache"
DEFAULT_WAIT_S = 600.0
_OPTIONS = ("socket_dir", "mode", "fallback", "wait", "verify")


def _parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"weightcache option {name!r} must be true or false, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    socket_dir: str | None = None
    mode: str = "map"
    fallback: bool = False
    wait: float = DEFAULT_WAIT_S
    verify: bool = False

    @classmethod
    def parse(cls, extra: dict | None) -> Options:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"unknown --model-loader-extra-config key(s) for --load-format {LOAD_FORMAT}: "
                             f"{unknown}; known: {list(_OPTIONS)}")
        mode = extra.get("mode", "map")
        if mode not in ("map", "copy"):
            raise ValueError(f"weightcache option 'mode' must be 'map' or 'copy', got {mode!r}")
        try:
            wait = float(extra.get("wait", DEFAULT_WAIT_S))
        except (TypeError, ValueError):
            raise ValueError(f"weightcache option 'wait' must be a number of seconds, got {extra['wait']!r}") from None
        if wait < 0:
            raise ValueError(f"weightcache option 'wait' must be >= 0, got {wait}")
        socket_dir = extra.get("socket_dir")
        return cls(socket_dir=str(socket_dir) if socket_dir else None, mode=mode,
                   fallback=_parse_bool("fallback", extra.get("fallback", False)), wait=wait,
                   verify=_parse_bool("verify", extra.get("verify", False)))


# ---- which daemon ----------------------------------------------------------------------------------------------


def is_draft_load(vllm_config: VllmConfig, model_config: ModelConfig) -> bool:
    """vLLM routes draft loads specially only for its ``ipc_cache``; recognise ours by the model config."""
    spec = vllm_config.speculative_config
    return spec is not None and spec.draft_model_config is not None and model_config is spec.draft_model_config


def engine_rank() -> int:
    """This worker's global rank: dp * pp * tp + pp * tp + tp, from vLLM's groups."""
    from vllm.distributed import get_dp_group, get_pp_group, get_tp_group

    tp, pp, dp = get_tp_group(), get_pp_group(), get_dp_group()
    return (dp.rank_in_group * pp.world_size + pp.rank_in_group) * tp.world_size + tp.rank_in_group


def target_device(vllm_config: VllmConfig, load_config: LoadConfig) -> torch.device:
    dev = torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# ---- binding ---------------------------------------------------------------------------------------------------


def bind_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], roles: dict[str, str], meta: dict) -> int:
    """Bind attached tensors into a model built on the meta device; returns how many names were bound. Scratch
    tensors that kernels write while running (``SCRATCH_ATTRIBUTES``, e.g. Marlin's workspace) are bound as this
    engine's own copies: the attached ones are shared and read-only."""
    from .common import META_NAME

    return len(bind_captured(model, private_scratch(tensors, meta), roles, meta, skip=frozenset({META_NAME})))


def private_scratch(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """``tensors`` with every scratch tensor (one named so, or aliased under such a name) replaced by a copy."""
    from .common import SCRATCH_ATTRIBUTES

    def scratch(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in SCRATCH_ATTRIBUTES

    names = {n for n in tensors if scratch(n)}
    names |= {canonical for alias, canonical in meta.get("aliases", {}).items() if scratch(alias)}
    return {n: (t.clone() if n in names else t) for n, t in tensors.items()}


def rebuild_kernels(model: nn.Module, owners) -> int:
    """Rebuild the objects the daemon's post-processing made from the processed weights (MoE kernels, Machete's
    activation permutation), for each recorded owner (a layer's quantization method, or a linear kernel it or
    the layer's scheme holds), from the weights just bound. Returns how many layers were rebuilt."""
    from .compat import has_pre_processed_mode
    from .compat import rebuild_kernels as rebuild

    modules = dict(model.named_modules(remove_duplicate=False))
    done: set[str] = set()
    for owner in owners:
        layer_name, obj = _owner(model, modules, owner)
        if has_pre_processed_mode() and layer_name in done:
            continue  # vLLM's pre-processed mode rebuilds a whole layer at once
        rebuild(modules[layer_name], obj)
        done.add(layer_name)
    return len(done)


def _owner(model: nn.Module, modules: dict, owner: str) -> tuple[str, object]:
    """(the layer holding ``owner``, the object at ``owner``): the longest module path that has a quantization
    method (which may itself be a module), then plain attributes."""
    parts = owner.split(".") if owner else []
    for cut in range(len(parts) - 1, -1, -1):
        name = ".".join(parts[:cut])
        layer = modules.get(name)
        if layer is None or getattr(layer, "quant_method", None) is None:
            continue
        obj = layer
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return name, obj
        break
    raise WeightCacheError(f"the cache says {owner} built kernels, but the model has no such layer: "
                           "the daemon was built for another configuration")


def bind_cpu_kernels(model: nn.Module) -> int:
    """vLLM's CPU backend computes with kernel handles (oneDNN / packed GEMM) made from each unquantized
    linear and embedding weight; a handle cannot cross processes, so each engine makes its own, exactly as
    vLLM's post-processing does on CPU (it reads the weight; the handle holds the kernel's own layout)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, UnquantizedLinearMethod):
            if getattr(module, "_cpu_skip_gemm_dispatch", False):
                module.cpu_linear = torch.nn.functional.linear
            else:
                dispatch_cpu_unquantized_gemm(module, remove_weight=True)
            n += 1
        elif isinstance(qm, UnquantizedEmbeddingMethod):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def leftover_meta(model: nn.Module, device: torch.device) -> list[str]:
    """Meta tensors still in the model: runtime placeholders (the KV cache, bound later by the runner)
    are materialized empty; anything else is returned (the cache lacks it)."""
    from .common import SKIP_ATTRIBUTES

    return model_state.leftover_meta(model, materialize=SKIP_ATTRIBUTES, device=device)


# ---- the loader ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter created meanwhile is a meta tensor (whatever its class: vLLM's parameter classes
    all construct through ``nn.Parameter.__new__``); other tensors stay on the default device."""
    original = nn.Parameter.__new__

    def new(cls, data=None, requires_grad=True):
        if data is not None and data.device.type != "meta":
            data = torch.empty_like(data, device="meta")
        return original(cls, data, requires_grad)

    nn.Parameter.__new__ = new
    try:
        yield
    finally:
        nn.Parameter.__new__ = original


def _skeleton(build, device: torch.device, registry: dict) -> nn.Module:
    """The model built on the meta device (no memory, no init). Where construction computes from tensor
    values (e.g. the expert map of expert parallelism), meta tensors cannot: then only the parameters are
    made on meta and the rest on the engine's device. ``registry``: vLLM's per-config table of layers,
    cleared of what a failed attempt registered."""
    known = set(registry)
    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError as e:
        log.info("the model cannot be built on the meta device alone (%s); building its parameters on meta",
                 str(e).splitlines()[0][:120])
    for name in set(registry) - known:
        del registry[name]
    with device, parameters_on_meta():
        return build()


def freeze_startup_heap() -> None:
    """Freeze the objects the engine's start made so far (young garbage collected first). vLLM's model runner
    collects garbage twice more once its loader returns (its memory profiler), each pass over the whole heap of
    vLLM's and torch's imports (0.4 s on the CPU machine); vLLM freezes that heap itself once the engine is up
    (`freeze_gc_heap`) and unfreezes it around CUDA graph capture: this only does it sooner."""
    gc.collect(1)
    gc.freeze()


class WeightCacheModelLoader(BaseModelLoader):
    """Attach post-processed weights from ``weightcache preload --engine vllm``."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config)

    # -- where / what

    def _socket_dir(self) -> Path:
        from ...sockets import default_socket_dir

        return Path(self.options.socket_dir) if self.options.socket_dir else default_socket_dir()

    def _key(self, vllm_config: VllmConfig, model_config: ModelConfig):
        from .common import cache_key

        role = "draft" if is_draft_load(vllm_config, model_config) else "main"
        return cache_key(vllm_config, model_config, role=role, rank=engine_rank())

    def _find(self, key, device: torch.device) -> Path:
        from ...sockets import device_tag, find_socket, socket_name

        tag = device_tag(device)
        socket_dir = self._socket_dir()
        try:
            return find_socket(socket_dir, key, tag)
        except DaemonUnavailable as e:
            raise DaemonUnavailable(
                f"{e}. Tried {socket_dir / socket_name(key, tag)}; start the daemons with "
                "`weightcache preload --engine vllm <the same vLLM flags>` or set fallback=true") from None

    def _fallback_config(self) -> LoadConfig:
        return dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})

    # -- BaseModelLoader

    def download_model(self, model_config: ModelConfig) -> None:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        DefaultModelLoader(self._fallback_config()).download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        raise NotImplementedError(
            "--load-format weightcache binds the daemon's post-processed weights when the model is built "
            "(load_model); reload weights in place with vLLM's reload_weights and mode=copy")

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module):
        """Checkpoint weights for vLLM's in-place ``reload_weights``; the reload writes into the bound
        weights, so it needs ``mode=copy`` (mapped weights are read-only)."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        if self.options.mode != "copy":
            raise WeightCacheError(
                "in-place weight reload writes into the weights, which --load-format weightcache maps "
                "read-only (mode=map); start the engine with "
                "--model-loader-extra-config '{\"mode\": \"copy\"}' to reload weights in place")
        return DefaultModelLoader(self._fallback_config()).get_all_weights(model_config, model)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes this worker will map from its daemons (main model + draft), counted inside the
        ``--gpu-memory-utilization`` budget; 0 in copy mode (the copy is the engine's own memory)."""
        if self.options.mode != "map":
            return 0
        from ...client import query_status, wait_ready
        from .compat import record_charge

        device = target_device(vllm_config, self.load_config)
        configs = [vllm_config.model_config]
        spec = vllm_config.speculative_config
        if spec is not None and spec.draft_model_config is not None:
            configs.append(spec.draft_model_config)
        total = 0
        for mc in configs:
            draft = mc is not vllm_config.model_config
            cfg = vllm_config
            if draft:
                from .common import draft_vllm_config

                cfg = draft_vllm_config(vllm_config)
            try:
                key = self._key(cfg, mc)
                path = self._find(key, device)
                st = query_status(path)
                if st.state == "loading":
                    st = wait_ready(path, self.options.wait, on_progress=_log_progress(path))
                if st.key != key:
                    raise KeyMismatch(_diffs(key, st.key), str(path))
                total += st.nbytes
                record_charge(str(path), draft, st.nbytes)
            except WeightCacheError as e:
                if not self.options.fallback:
                    raise
                log.warning("weight cache for the %s model unusable (%s); counting no external memory",
                            "draft" if draft else "main", e)
        return total

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        from ...client import attach, wait_ready
        from .compat import warn_if_untested

        warn_if_untested()
        device = target_device(vllm_config, self.load_config)
        role = "draft" if is_draft_load(vllm_config, model_config) else "main"
        t0 = time.perf_counter()
        path = None
        spent = self.spent = {}
        try:
            with _timed(spent, "key"):
                key = self._key(vllm_config, model_config)
                path = self._find(key, device)
            log.info("attaching the %s model (rank %d) from %s", role, key.rank, path)
            try:
                with _timed(spent, "attach"):
                    att = attach(path, expect=key, mode=self.options.mode,  # the key is checked while loading too
                                 verify=self.options.verify)
            except DaemonNotReady as e:
                if e.state != "loading":
                    raise
                log.info("the weight cache at %s is loading; waiting up to %.0f s", path, self.options.wait)
                wait_ready(path, self.options.wait, on_progress=_log_progress(path))
                att = attach(path, expect=key, mode=self.options.mode, verify=self.options.verify)
        except (DaemonUnavailable, KeyMismatch, DaemonNotReady, IntegrityError) as e:
            if not self.options.fallback:
                raise
            log.warning("weight cache unusable for the %s model, loading it from disk (fallback=true): %s",
                        role, e)
            if path is not None:
                from .compat import record_fallback

                record_fallback(str(path), role == "draft")
            return self._disk_load(vllm_config, model_config, prefix)
        model = self._build(vllm_config, model_config, prefix, att, device)
        log.info("attached %d tensors (%.2f GiB, mode=%s) for the %s model in %.3f s (%s)", len(att),
                 att.nbytes / 2**30, self.options.mode, role, time.perf_counter() - t0,
                 ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in spent.items()))
        freeze_startup_heap()
        return model

    def _disk_load(self, vllm_config, model_config, prefix):
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        return DefaultModelLoader(self._fallback_config()).load_model(
            vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    def _build(self, vllm_config, model_config, prefix, att, device) -> nn.Module:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        from .common import check_quantization, read_meta

        spent = getattr(self, "spent", {})
        meta = read_meta(att)
        with _timed(spent, "skeleton"), set_default_torch_dtype(model_config.dtype):
            model = _skeleton(lambda: initialize_model(vllm_config=vllm_config, model_config=model_config,
                                                       prefix=prefix), device,
                              vllm_config.compilation_config.static_forward_context)
        with _timed(spent, "bind"):
            check_quantization(model)
            apply_deletions(model, meta.get("deleted", ()))
            bind_tensors(model, dict(att.tensors), att.roles, meta)
            apply_scalars(model, meta.get("scalars", {}))
        with _timed(spent, "kernels"):
            rebuild_kernels(model, meta.get("rebuild", ()))
        missing = leftover_meta(model, device)
        if missing:
            raise WeightCacheError(
                f"the cache lacks {len(missing)} tensor(s) this engine's model has, e.g. "
                f"{', '.join(missing[:5])}: the daemon was built for another configuration")
        t0 = time.perf_counter()
        if bind_cpu_kernels(model):
            log.info("made vLLM's CPU GEMM kernel handles from the attached weights in %.2f s",
                     time.perf_counter() - t0)
        # In-place reloads materialize layers on the device recorded at construction (meta here).
        for module in model.modules():
            get_layerwise_info(module).restore_device = device
        model.__dict__["_weightcache_attachment"] = att  # keeps the daemon connection (and count) open
        return model.eval()


@contextlib.contextmanager
def _timed(spent: dict, what: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        spent[what] = spent.get(what, 0.0) + time.perf_counter() - t


def _diffs(expected, actual):
    from ...key import diff

    return diff(expected, actual)


def _log_progress(path):
    last = [0.0]

    def on_progress(st) -> None:
        if time.monotonic() - last[0] >= 5.0:
            last[0] = time.monotonic()
            pct = f"{100.0 * st.done / st.total:.0f}% packed" if st.total else "building the model"
            log.info("waiting for the weight cache at %s to load (%s)", path, pct)

    return on_progress


# ---- parity ----------------------------------------------------------------------------------------------------


def engine_state(model: nn.Module, probe_seed: int = 0) -> dict[str, torch.Tensor]:
    """What an engine computes with: every tensor reachable from the model (parameters, buffers, tensor
    attributes of modules and of their quantization methods / kernels), plus, for each kernel handle
    (vLLM's CPU GEMMs hold their weights inside), its output on a fixed input as ``probe:<module>``."""
    from .common import reachable_tensors

    tensors, _ = reachable_tensors(model, rebuilt=True)
    out = {k: v for k, v in tensors.items() if not v.is_meta}
    g = torch.Generator().manual_seed(probe_seed)
    for name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        if not callable(fn):
            continue
        k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        dtype = getattr(module, "params_dtype", None) or torch.get_default_dtype()
        if not k:
            continue
        x = torch.randn(3, int(k), generator=g).to(dtype)
        with torch.no_grad():
            out[f"probe:{name}"] = fn(x, module.weight, getattr(module, "bias", None))
    return out
