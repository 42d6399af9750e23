"""Plain PyTorch engine: bind attached tensors into a module built on the meta device.

``load_into(module, source)`` has ``module.load_state_dict(state, assign=True)`` semantics with the checks an
engine needs before it serves: every parameter and persistent buffer must come from the cache with the
module's shape and dtype, tied parameters stay tied (one tensor, one ``Parameter``), non-persistent buffers
are taken from the cache when it holds them or recomputed by the module's own initialisation on the
attached device, and no meta tensor is ever left behind.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import DaemonUnavailable, WeightCacheError
from ..sockets import socket_in_dir

log = logging.getLogger("weightcache.integrations.torch")

# (root module, dotted name of the owner, owner) -> fills the owner's non-persistent buffers in place
BufferInit = Callable[[nn.Module, str, nn.Module], None]

_MAX_LISTED = 12


class BindError(WeightCacheError, ValueError):
    """The cached tensors do not fit the module: missing / unexpected keys, shape or dtype mismatches,
    tensors the module's initialisation could not recompute."""

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)  # (name, expected, actual)
        super().__init__(message)


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in shown) + more


def _split(name: str) -> tuple[str, str]:
    owner, _, leaf = name.rpartition(".")
    return owner, leaf


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


# ---- finding the cache ---------------------------------------------------------------------------------------


def open_source(source, *, expect=None, device=None, mode: str = "map", readonly: bool = True,
                wait: float = 0.0, timeout: float = 10.0):
    """An Attachment for ``source``: an Attachment (returned as is), a socket path, or a socket directory."""
    from ..client import Attachment, attach

    if isinstance(source, Attachment):
        if source.closed and not len(source):
            raise WeightCacheError("the attachment passed to load_into is closed")
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"source must be an Attachment, a socket path or a socket directory, not {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        path = socket_in_dir(path, expect, device)
    elif not path.exists():
        raise DaemonUnavailable(f"no weight cache daemon at {path} (no such socket or directory)")
    return attach(path, expect=expect, mode=mode, readonly=readonly, wait=wait, timeout=timeout)


# ---- what the module holds -----------------------------------------------------------------------------------


class _Slot:
    """One tensor object of the module under all the names it is registered as (ties share one slot)."""

    __slots__ = ("kind", "names", "tensor", "persistent")

    def __init__(self, kind: str, tensor: torch.Tensor, persistent: bool):
        self.kind = kind  # "parameter" | "buffer"
        self.names: list[str] = []
        self.tensor = tensor
        self.persistent = persistent


def _slots(module: nn.Module) -> list[_Slot]:
    by_id: dict[int, _Slot] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for leaf, p in mod._parameters.items():
            if p is None:
                continue
            slot = by_id.setdefault(id(p), _Slot("parameter", p, True))
            name = f"{prefix}.{leaf}" if prefix else leaf
            if name not in slot.names:
                slot.names.append(name)
        for leaf, b in mod._buffers.items():
            if b is None:
                continue
            persistent = leaf not in mod._non_persistent_buffers_set
            slot = by_id.setdefault(id(b), _Slot("buffer", b, persistent))
            slot.persistent = slot.persistent or persistent
            name = f"{prefix}.{leaf}" if prefix else leaf
            if name not in slot.names:
                slot.names.append(name)
    return list(by_id.values())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.dtype, a.shape, a.stride()) == (b.data_ptr(), b.dtype, b.shape, b.stride())


# ---- recomputing non-persistent buffers ----------------------------------------------------------------------


def _hf_model_for(root: nn.Module, owner_name: str):
    """The nearest transformers PreTrainedModel at or above ``owner_name`` (its ``_init_weights`` rules)."""
    parts = owner_name.split(".") if owner_name else []
    for n in range(len(parts), -1, -1):
        cand = root.get_submodule(".".join(parts[:n]))
        if hasattr(cand, "_init_weights") and any(
            c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(cand).__mro__
        ):
            return cand
    return None


def _unset(t) -> bool:
    return isinstance(t, torch.Tensor) and (
        t.is_meta or ((t.is_floating_point() or t.is_complex()) and t.numel() > 0 and bool(torch.isnan(t).all()))
    )


def _hf_rotary_fallback(owner: nn.Module) -> None:
    """A transformers rotary embedding whose ``_init_weights`` did not fill ``inv_freq`` (versions without
    that rule): compute it with the module's own rope function on the CPU, as its ``__init__`` does."""
    if not _unset(owner._buffers.get("inv_freq")) or not hasattr(owner, "config"):
        return
    fn = getattr(owner, "rope_init_fn", None)
    rope_type = getattr(owner, "rope_type", "default")
    if fn is None and rope_type == "default":
        fn = getattr(owner, "compute_default_rope_parameters", None)
    if fn is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = fn(owner.config)
    owner.inv_freq.copy_(inv_freq)
    orig = owner._buffers.get("original_inv_freq")
    if orig is not None:
        orig.copy_(inv_freq)
    elif _unset(owner.__dict__.get("original_inv_freq")):  # a plain attribute in some versions
        owner.original_inv_freq = owner.inv_freq.clone()


def default_init_buffers(root: nn.Module, owner_name: str, owner: nn.Module) -> None:
    """Recompute an owner's non-persistent buffers the way the model initialises them: a transformers
    model's own ``_init_weights`` (what ``from_pretrained`` runs for them), else ``owner.reset_parameters()``
    (the PyTorch convention after ``to_empty``). Parameters are still on the meta device here, so an
    initialiser's writes to them are no-ops."""
    hf = _hf_model_for(root, owner_name)
    if hf is not None:
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:  # older transformers
            hf._init_weights(owner)
        else:
            with guard_torch_init_functions():
                hf._init_weights(owner)
        _hf_rotary_fallback(owner)
        return
    reset = getattr(owner, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    raise BindError(
        f"{type(owner).__name__} at {owner_name or '<root>'!r} has non-persistent buffers on the meta device, "
        "they are not in the cache, and the module has no reset_parameters() to recompute them: build it with "
        "its buffers on a real device (weightcache.integrations.torch.init_empty()), publish them with role "
        "'nonpersistent_buffer', or pass init_buffers="
    )


def _recompute_buffers(root: nn.Module, slots: list[_Slot], device: torch.device, init_buffers: BufferInit) -> None:
    owners: dict[str, list[_Slot]] = {}
    for slot in slots:
        owners.setdefault(_split(slot.names[0])[0], []).append(slot)
    for owner_name, owned in owners.items():
        owner = root.get_submodule(owner_name)
        for slot in owned:
            fresh = torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype, device=device)
            if fresh.is_floating_point() or fresh.is_complex():
                fresh.fill_(math.nan)  # sentinel: an initialiser that does not write them is caught below
            for name in slot.names:
                o, leaf = _split(name)
                root.get_submodule(o)._buffers[leaf] = fresh
        try:
            with torch.no_grad():
                init_buffers(root, owner_name, owner)
        except BindError:
            raise
        except Exception as e:
            raise BindError(
                f"recomputing the non-persistent buffers of {owner_name or '<root>'} "
                f"({', '.join(s.names[0] for s in owned)}) failed: {type(e).__name__}: {e}"
            ) from e
        for slot in owned:
            o, leaf = _split(slot.names[0])
            t = root.get_submodule(o)._buffers[leaf]
            if t is None or t.device.type == "meta":
                raise BindError(f"non-persistent buffer {slot.names[0]} is still on the meta device after its init")
            if t.device != device:
                t = t.to(device)
            if (t.is_floating_point() or t.is_complex()) and t.numel() and bool(torch.isnan(t).all()):
                raise BindError(
                    f"non-persistent buffer {slot.names[0]} was not recomputed by {type(owner).__name__}'s "
                    "initialisation; publish it with role 'nonpersistent_buffer' or pass init_buffers="
                )
            for name in slot.names:
                o2, leaf2 = _split(name)
                root.get_submodule(o2)._buffers[leaf2] = t


# ---- binding ---------------------------------------------------------------------------------------------------


def _check(slot: _Slot, t: torch.Tensor, name: str, mismatched: list) -> None:
    if tuple(t.shape) != tuple(slot.tensor.shape) or t.dtype != slot.tensor.dtype:
        mismatched.append((name, _describe(slot.tensor), _describe(t)))


def _new_param(old: nn.Parameter, t: torch.Tensor) -> nn.Parameter:
    grad = old.requires_grad and (t.is_floating_point() or t.is_complex())
    new = nn.Parameter(t, requires_grad=grad)
    for k, v in getattr(old, "__dict__", {}).items():  # engine attributes (weight_loader, flags) travel along
        setattr(new, k, v)
    return new


def bind(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    roles: Mapping[str, str] | None = None,
    device: torch.device | str | None = None,
    strict: bool = True,
    init_buffers: BufferInit | None = None,
    ignore_unexpected: Iterable[str] = (),
    untie_conflicting: bool = False,
) -> nn.Module:
    """Bind ``tensors`` (name -> tensor) into ``module`` in place; see :func:`load_into`. Everything is checked
    before anything is changed, so a refused bind leaves the module as it was."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_into needs a torch.nn.Module, not {type(module).__name__}")
    roles = dict(roles or {})
    if device is None:
        first = next(iter(tensors.values()), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    ignore = [re.compile(p) for p in ignore_unexpected]
    slots = _slots(module)

    missing: list[str] = []
    mismatched: list[tuple[str, str, str]] = []
    conflicts: list[str] = []
    plan: list[tuple[_Slot, list[tuple[list[str], torch.Tensor]]]] = []  # slot -> [(names, tensor)]
    recompute: list[_Slot] = []
    moves: list[_Slot] = []
    used: set[str] = set()
    for slot in slots:
        present = [n for n in slot.names if n in tensors]
        used.update(present)
        if not present:
            if slot.kind == "buffer" and not slot.persistent:
                (recompute if slot.tensor.device.type == "meta" else moves).append(slot)
            elif slot.tensor.device.type == "meta" or strict:
                missing.append(" = ".join(slot.names) if len(slot.names) > 1 else slot.names[0])
            continue
        first = tensors[present[0]]
        for n in present:
            _check(slot, tensors[n], n, mismatched)
        differing = [n for n in present[1:] if not _same_view(tensors[n], first)]
        if differing and not all(torch.equal(tensors[n], first) for n in differing):
            if not untie_conflicting:
                conflicts.append(f"{present[0]} vs {', '.join(differing)}")
                continue
            log.warning("the module ties %s but the cache holds different values; untying them", present)
            groups = [([n], tensors[n]) for n in present]
            rest = [n for n in slot.names if n not in present]
            groups[0][0].extend(rest)
            plan.append((slot, groups))
            continue
        plan.append((slot, [(list(slot.names), first)]))

    # tensors the cache marks as plain attributes (e.g. scales kept outside the parameter list)
    attributes: list[tuple[nn.Module, str, torch.Tensor]] = []
    for name, t in tensors.items():
        if name in used or roles.get(name) != "attribute":
            continue
        owner_name, leaf = _split(name)
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            continue
        cur = owner.__dict__.get(leaf)
        if isinstance(cur, torch.Tensor):
            if tuple(cur.shape) != tuple(t.shape) or cur.dtype != t.dtype:
                mismatched.append((name, _describe(cur), _describe(t)))
            used.add(name)
            attributes.append((owner, leaf, t))
    unexpected = [n for n in tensors if n not in used and not any(p.search(n) for p in ignore)]

    problems = []
    if missing:
        problems.append(_listing("missing from the cache", missing))
    if unexpected and strict:
        problems.append(_listing("unexpected (in the cache, not in the module)", unexpected))
    if mismatched:
        problems.append(_listing("shape/dtype mismatch (module expects vs cache holds)",
                                 [f"{n}: {e} vs {a}" for n, e, a in mismatched]))
    if conflicts:
        problems.append(_listing("tied in the module but different in the cache", conflicts))
    if problems:
        raise BindError(
            f"cannot bind the cached weights into {type(module).__name__}:\n" + "\n".join(problems),
            missing=missing, unexpected=unexpected if strict else [], mismatched=mismatched,
        )

    # nothing refused: change the module
    if recompute:
        _recompute_buffers(module, recompute, device, init_buffers or default_init_buffers)
    for slot in moves:
        moved = slot.tensor.to(device)
        for name in slot.names:
            o, leaf = _split(name)
            module.get_submodule(o)._buffers[leaf] = moved
    for slot, groups in plan:
        for names, t in groups:
            value = _new_param(slot.tensor, t) if slot.kind == "parameter" else t
            for name in names:
                o, leaf = _split(name)
                owner = module.get_submodule(o)
                if slot.kind == "parameter":
                    owner._parameters[leaf] = value
                else:
                    owner._buffers[leaf] = value
    for owner, leaf, t in attributes:
        setattr(owner, leaf, t)

    left = [n for s in _slots(module) for n in s.names[:1] if s.tensor.device.type == "meta"]
    for prefix, mod in module.named_modules():
        left += [f"{prefix}.{k}" if prefix else k for k, v in vars(mod).items()
                 if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.device.type == "meta"]
    if left:
        raise BindError(_listing("tensors left on the meta device after binding", left), missing=left)
    return module


def load_into(
    module: nn.Module,
    source,
    *,
    strict: bool = True,
    expect=None,
    device: torch.device | str | None = None,
    mode: str = "map",
    readonly: bool = True,
    wait: float = 0.0,
    timeout: float = 10.0,
    init_buffers: BufferInit | None = None,
    ignore_unexpected: Iterable[str] = (),
    untie_conflicting: bool = False,
):
    """Bind the weights of a cache into ``module`` (typically built under ``torch.device("meta")``).

    ``source`` is an :class:`~weightcache.client.Attachment`, a daemon's socket path, or a socket directory
    (then ``expect`` — a CacheKey — and ``device`` pick the daemon, or the directory holds exactly one).
    ``strict=False`` tolerates cache entries the module does not have and module tensors the cache lacks
    as long as those already live on a real device; a shape or dtype mismatch is always an error.
    Returns the Attachment; the module keeps a reference to it (``module._weightcache_attachment``), so the
    connection to the daemon lives as long as the module."""
    att = open_source(source, expect=expect, device=device, mode=mode, readonly=readonly, wait=wait, timeout=timeout)
    try:
        bind(module, att, roles=att.roles, device=att.device, strict=strict, init_buffers=init_buffers,
             ignore_unexpected=ignore_unexpected, untie_conflicting=untie_conflicting)
    except BaseException:
        if att is not source:
            att.close()
        raise
    module.__dict__["_weightcache_attachment"] = att
    return att


class init_empty:
    """Build parameters on the meta device while buffers are created for real (on ``buffer_device``), so the
    module's own ``__init__`` computes its non-persistent buffers; ``load_into`` then moves them to the cache's
    device. Parameter initialisers (``torch.nn.init.*``) are skipped inside, so building is cheap:

        with init_empty():
            model = MyModel(cfg)
        load_into(model, socket)
    """

    def __init__(self, buffer_device: torch.device | str = "cpu"):
        self.buffer_device = torch.device(buffer_device)
        self._saved: dict = {}

    def __enter__(self):
        orig = nn.Module.register_parameter

        def register_parameter(mod, name, param):
            orig(mod, name, param)
            p = mod._parameters.get(name)
            if p is not None and p.device.type != "meta":
                meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                meta.__dict__.update(p.__dict__)
                mod._parameters[name] = meta

        self._saved = {"register_parameter": orig}
        nn.Module.register_parameter = register_parameter
        for fname in dir(nn.init):
            fn = getattr(nn.init, fname)
            if fname.endswith("_") and not fname.startswith("_") and callable(fn):
                self._saved[fname] = fn
                setattr(nn.init, fname, lambda tensor, *a, **k: tensor)
        self._device_ctx = torch.device(self.buffer_device)
        self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._device_ctx.__exit__(*exc)
        nn.Module.register_parameter = self._saved.pop("register_parameter")
        for fname, fn in self._saved.items():
            setattr(nn.init, fname, fn)
        self._saved = {}
        return False


__all__ = ["BindError", "BufferInit", "bind", "default_init_buffers", "init_empty", "load_into", "open_source"]
