"""What a built model holds beyond its parameter list, taken out of one process and put back in another.

An engine's loader leaves a model whose forward reads parameters, buffers and tensors kept as plain
attributes (of modules and of the plain objects they hold, e.g. quantization methods), and host-side Python
state that loading set (flags, floats, deleted placeholders). A daemon captures all of it once
(:func:`reachable_tensors`, :func:`python_state`, :func:`state_changes`, :func:`split_aliases`); the side
data that is not a tensor travels as JSON in a uint8 tensor (:func:`side_data_tensor`). The engine builds the
same model on the meta device and puts everything back (:func:`bind_captured`, :func:`apply_scalars`,
:func:`apply_deletions`); :func:`parity` compares two models' tensors byte for byte.

Which plain objects are walked, which attributes are runtime state or rebuilt by the engine, is each
engine's :class:`Rules`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..dtypes import dtype_name, parse_dtype
from ..errors import WeightCacheError

_SCALARS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Rules:
    """How one engine's models are walked.

    ``walkable(obj)``: plain (non-module) objects whose attributes may hold tensors or state. ``skip``:
    attributes that are runtime state, never captured. ``rebuilt``: objects the engine makes again from the
    bound tensors (recorded as "rebuilt", not shipped). ``engine_made``: objects loading may create that the
    engine makes itself (not refused). ``max_depth``: how deep plain objects are followed."""

    walkable: Callable[[object], bool]
    skip: frozenset = field(default_factory=frozenset)
    rebuilt: frozenset = field(default_factory=frozenset)
    engine_made: frozenset = field(default_factory=frozenset)
    max_depth: int = 3


def walkable_in(*packages: str, exclude_suffixes: tuple[str, ...] = ("Config",)) -> Callable[[object], bool]:
    """A ``Rules.walkable`` for plain objects of classes defined in ``packages`` (their names not ending
    in ``exclude_suffixes``)."""
    prefixes = tuple(p if p.endswith(".") else p + "." for p in packages)

    def walkable(obj) -> bool:
        if isinstance(obj, (nn.Module, torch.Tensor, type)) or not hasattr(obj, "__dict__"):
            return False
        mod = type(obj).__module__ or ""
        return mod.startswith(prefixes) and not type(obj).__name__.endswith(exclude_suffixes)

    return walkable


# ---- scalars ---------------------------------------------------------------------------------------------------


def encode_scalar(v):
    """A JSON form of a host-side scalar attribute, or None when it is not one."""
    if isinstance(v, _SCALARS):
        return {"v": v}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v):
        return {"list" if isinstance(v, list) else "tuple": list(v)}
    return None


def decode_scalar(enc: dict):
    if "v" in enc:
        return enc["v"]
    if "dtype" in enc:
        return parse_dtype(enc["dtype"])
    if "tuple" in enc:
        return tuple(enc["tuple"])
    return list(enc["list"])


# ---- capture (the daemon's side) -------------------------------------------------------------------------------


def _module_internals() -> frozenset:
    return frozenset(vars(nn.Module()))


def python_state(model: nn.Module, rules: Rules) -> dict[str, dict[str, tuple]]:
    """Per owner path (modules and the walkable objects they hold), each attribute's kind: a tensor, a
    host-side scalar (with its value), "rebuilt" (with whether it is set) or another object (held, so
    identity can be compared)."""
    internals = _module_internals()
    state: dict[str, dict[str, tuple]] = {}

    def record(path: str, items, depth: int) -> None:
        entry = state.setdefault(path, {})
        for attr, v in items:
            if attr in rules.rebuilt:
                entry[attr] = ("rebuilt", v is not None)
                continue
            if isinstance(v, torch.Tensor):
                entry[attr] = ("tensor", None)
                continue
            enc = encode_scalar(v)
            if enc is not None:
                entry[attr] = ("scalar", enc)
                continue
            entry[attr] = ("object", v)
            if rules.walkable(v) and depth < rules.max_depth:
                record(f"{path}.{attr}" if path else attr, list(vars(v).items()), depth + 1)

    for mname, module in model.named_modules(remove_duplicate=False):
        items = [(k, v) for k, v in vars(module).items() if k not in internals]
        items += list(module._parameters.items()) + list(module._buffers.items())  # None: a scalar
        record(mname, items, 0)
    return state


def state_changes(before: dict, after: dict, rules: Rules) -> tuple[dict[str, dict], list[str], list[str], list[str]]:
    """(host-side scalars set or changed, attributes deleted, objects created, owners whose rebuilt objects
    the engine makes again) between two :func:`python_state` snapshots."""
    scalars, deleted, created, rebuilt = {}, [], [], []
    for path, attrs in after.items():
        old = before.get(path, {})
        for attr, (kind, val) in attrs.items():
            name = f"{path}.{attr}" if path else attr
            prev = old.get(attr)
            if kind == "rebuilt":
                if val and path not in rebuilt:
                    rebuilt.append(path)
            elif kind == "scalar" and prev != (kind, val):
                scalars[name] = val
            elif kind == "object" and (prev is None or prev[0] != "object" or prev[1] is not val):
                if attr not in rules.engine_made and path in before:
                    created.append(f"{name} ({type(val).__name__})")
        for attr in old:
            if attr not in attrs and path in after:
                deleted.append(f"{path}.{attr}" if path else attr)
    return scalars, deleted, created, rebuilt


def reachable_tensors(model: nn.Module, rules: Rules, *, include_rebuilt: bool = False
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor the model's forward can read, by every name it is reachable under, with its role:
    parameters, buffers, and tensors held as plain attributes of modules and of the walkable objects they
    hold, up to ``rules.max_depth`` levels deep. Objects the engine rebuilds are walked only with
    ``include_rebuilt`` (for parity checks)."""
    skipped = rules.skip if include_rebuilt else rules.skip | rules.rebuilt
    tensors: dict[str, torch.Tensor] = {}
    roles: dict[str, str] = {}

    def add(name: str, t, role: str) -> None:
        if isinstance(t, torch.Tensor) and name not in tensors:
            tensors[name] = t
            roles[name] = role

    def walk(prefix: str, obj, depth: int, seen: set) -> None:
        if depth > rules.max_depth or id(obj) in seen:
            return
        seen.add(id(obj))
        for attr, v in vars(obj).items():
            if attr in skipped:
                continue
            if isinstance(v, torch.Tensor):
                add(f"{prefix}.{attr}", v, "attribute")
            elif rules.walkable(v):
                walk(f"{prefix}.{attr}", v, depth + 1, seen)

    for mname, module in model.named_modules(remove_duplicate=False):
        pre = f"{mname}." if mname else ""
        for leaf, p in module._parameters.items():
            if p is not None:
                add(pre + leaf, p, "parameter")
        for leaf, b in module._buffers.items():
            if b is not None:
                add(pre + leaf, b, "nonpersistent_buffer" if leaf in module._non_persistent_buffers_set else "buffer")
        seen: set = set()
        for attr, v in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules") or attr in skipped:
                continue
            if isinstance(v, torch.Tensor):
                add(pre + attr, v, "attribute")
            elif rules.walkable(v):
                walk(pre + attr, v, 1, seen)
    return tensors, roles


def split_aliases(everything: Mapping[str, torch.Tensor], roles: Mapping[str, str], *,
                  local: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str], list[str]]:
    """(tensors to pack, each object once; their roles; alias -> first name; names left on the meta
    device). ``local`` maps a tensor to the one to pack (e.g. a DTensor's local shard)."""
    tensors: dict[str, torch.Tensor] = {}
    out_roles: dict[str, str] = {}
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    skipped: list[str] = []
    for name, t in everything.items():
        if t.device.type == "meta":
            skipped.append(name)
            continue
        first = canonical.get(id(t))
        if first is not None:
            aliases[name] = first
            continue
        canonical[id(t)] = name
        packed = local(t) if local is not None else t
        tensors[name] = packed.detach() if roles[name] != "parameter" or packed is not t else packed
        out_roles[name] = roles[name]
    return tensors, out_roles, aliases, skipped


def side_data_tensor(meta: dict, device: torch.device) -> torch.Tensor:
    """JSON side data as a uint8 tensor on ``device`` (it travels with the weights)."""
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).clone().to(device)


def read_side_data(tensors: Mapping[str, torch.Tensor], name: str, fmt: int, what: str, missing: str) -> dict:
    """The JSON side data under ``name``; ``missing`` is the error when the cache has none."""
    t = tensors.get(name)
    if t is None:
        raise WeightCacheError(missing)
    meta = json.loads(bytes(t.cpu().numpy()))
    if meta.get("format") != fmt:
        raise WeightCacheError(f"{what} side data format {meta.get('format')} is not {fmt}; "
                               "restart the preload with this weightcache version")
    return meta


# ---- putting it back (the engine's side) -----------------------------------------------------------------------


def owner_of(root: nn.Module, modules: dict[str, nn.Module], name: str):
    """(object holding the leaf, leaf) for a dotted name: a module path, then plain attributes."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        mod = modules.get(".".join(parts[:cut]))
        if mod is None:
            continue
        obj = mod
        for attr in parts[cut:-1]:
            obj = getattr(obj, attr, None)
            if obj is None:
                raise WeightCacheError(f"cached tensor {name}: the model has no {attr!r} at {'.'.join(parts[:cut])}")
        return obj, parts[-1]
    raise WeightCacheError(f"cached tensor {name}: no such module in the model")


def new_parameter(old, t: torch.Tensor, *, keep_class: bool, requires_grad: bool | None = False) -> nn.Parameter:
    """A Parameter over ``t`` that keeps the old one's attributes (and class with ``keep_class``).
    ``requires_grad=None`` follows the old parameter (floating-point tensors only)."""
    if requires_grad is None:
        requires_grad = bool(getattr(old, "requires_grad", False)) and (t.is_floating_point() or t.is_complex())
    p = nn.Parameter(t, requires_grad=requires_grad)
    if isinstance(old, nn.Parameter):
        if keep_class and type(old) is not nn.Parameter:
            p.__class__ = type(old)
        p.__dict__.update({k: v for k, v in old.__dict__.items() if k not in p.__dict__})
    return p


def bind_captured(model: nn.Module, tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str], meta: dict, *,
                  skip: frozenset = frozenset(), requires_grad: bool | None | Callable = False,
                  wrap: Callable[[object, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Bind captured tensors into a model built on the meta device under every name the daemon saw them
    (``meta["aliases"]``); returns name -> what was bound. A parameter whose shape or dtype differs from the
    one the model built is refused unless ``meta["replaced"]`` names it. ``wrap(old, t)`` may turn an
    attached tensor into what the old one was (e.g. a DTensor over a local shard). ``requires_grad``: a bool,
    None (as the parameter the model built, floating point only) or ``fn(name, tensor) -> bool``."""
    modules = dict(model.named_modules(remove_duplicate=False))
    replaced = set(meta.get("replaced", ()))
    bound: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor, role: str) -> None:
        obj, leaf = owner_of(model, modules, name)
        if role == "parameter":
            if not isinstance(obj, nn.Module):
                raise WeightCacheError(f"cached parameter {name} is not owned by a module")
            old = obj._parameters.get(leaf)
            if wrap is not None and old is not None and not isinstance(t, nn.Parameter):
                t = wrap(old, t)
            if old is not None and (old.shape != t.shape or old.dtype != t.dtype) and name not in replaced:
                raise WeightCacheError(
                    f"cached parameter {name} is {t.dtype}{list(t.shape)} but the model builds "
                    f"{old.dtype}{list(old.shape)}: the daemon was built for another configuration")
            grad = requires_grad(name, t) if callable(requires_grad) else requires_grad
            p = t if isinstance(t, nn.Parameter) else new_parameter(old, t, keep_class=name not in replaced,
                                                                     requires_grad=grad)
            obj._buffers.pop(leaf, None)
            if leaf in obj._parameters or not hasattr(obj, leaf):
                obj._parameters[leaf] = p
            else:
                delattr(obj, leaf)
                obj.register_parameter(leaf, p)
            bound[name] = p
        elif role in ("buffer", "nonpersistent_buffer"):
            obj._parameters.pop(leaf, None)
            if leaf in obj._buffers:
                obj._buffers[leaf] = t
                if role == "nonpersistent_buffer":
                    obj._non_persistent_buffers_set.add(leaf)
            else:
                if hasattr(obj, leaf):
                    delattr(obj, leaf)
                obj.register_buffer(leaf, t, persistent=role == "buffer")
            bound[name] = t
        else:
            if isinstance(obj, nn.Module):
                obj._parameters.pop(leaf, None)
                obj._buffers.pop(leaf, None)
            object.__setattr__(obj, leaf, t)
            bound[name] = t

    for name, t in tensors.items():
        if name not in skip:
            put(name, t, roles.get(name, "parameter"))
    for alias, canonical in meta.get("aliases", {}).items():
        t = bound.get(canonical)
        if t is None:
            raise WeightCacheError(f"cached alias {alias} names {canonical}, which the cache does not hold")
        role = "parameter" if isinstance(t, nn.Parameter) else roles.get(canonical, "attribute")
        if not isinstance(owner_of(model, modules, alias)[0], nn.Module):
            role = "attribute"  # the same tensor also held by a plain object (e.g. a kernel or a map manager)
        put(alias, t, role)
    return bound


def apply_deletions(model: nn.Module, names) -> None:
    """Drop what the daemon's loading deleted (placeholders consumed by post-processing)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name in names:
        try:
            obj, leaf = owner_of(model, modules, name)
        except WeightCacheError:
            continue  # its owner is gone too
        if isinstance(obj, nn.Module) and (leaf in obj._parameters or leaf in obj._buffers):
            obj._parameters.pop(leaf, None)
            obj._buffers.pop(leaf, None)
        elif hasattr(obj, leaf):
            delattr(obj, leaf)


def apply_scalars(model: nn.Module, scalars: dict) -> None:
    """Set the host-side scalars the daemon's loading set (flags, floats, ``input_scale = None``, ...)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, enc in scalars.items():
        obj, leaf = owner_of(model, modules, name)
        if isinstance(obj, nn.Module):
            obj._parameters.pop(leaf, None)
            obj._buffers.pop(leaf, None)
        object.__setattr__(obj, leaf, decode_scalar(enc))


def leftover_meta(model: nn.Module, *, materialize: frozenset[str] = frozenset(), device=None) -> list[str]:
    """Names of tensors still on the meta device (parameters, buffers, tensor attributes of modules). Tensor
    attributes named in ``materialize`` (runtime placeholders an engine binds later, e.g. the KV cache) are
    made empty on ``device`` instead of being listed."""
    missing = []
    for mname, module in model.named_modules():
        pre = f"{mname}." if mname else ""
        for coll in (module._parameters, module._buffers):
            missing += [pre + k for k, v in coll.items() if v is not None and v.is_meta]
        for k, v in list(vars(module).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.is_meta:
                if k in materialize:
                    object.__setattr__(module, k, torch.empty_like(v, device=device))
                else:
                    missing.append(pre + k)
    return missing


# ---- parity ----------------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def parity(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> list[str]:
    """Differences between two name -> tensor maps: names on one side only, dtype/shape/byte mismatches."""
    diffs = [f"missing: {n}" for n in sorted(set(expected) - set(actual))]
    diffs += [f"unexpected: {n}" for n in sorted(set(actual) - set(expected))]
    for n in sorted(set(expected) & set(actual)):
        a, b = expected[n], actual[n]
        if a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{n}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(tensor_bytes(a), tensor_bytes(b)):
            diffs.append(f"{n}: bytes differ")
    return diffs


__all__ = ["Rules", "apply_deletions", "apply_scalars", "bind_captured", "decode_scalar", "encode_scalar",
           "leftover_meta", "new_parameter", "owner_of", "parity", "python_state", "reachable_tensors",
           "read_side_data", "side_data_tensor", "split_aliases", "state_changes", "tensor_bytes", "walkable_in"]
