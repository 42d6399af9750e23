"""Dtypes in one table: torch's names, safetensors' codes and item sizes. Imports torch only to turn a name
into a ``torch.dtype`` (the manifest, the wire and the custodian stay free of it)."""

from __future__ import annotations

import functools

# safetensors code -> (torch's name, item size in bytes)
SAFETENSORS: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "C64": ("complex64", 8),
}
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_ITEMSIZE = {name: size for name, size in SAFETENSORS.values()} | {
    "complex128": 16, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float4_e2m1fn_x2": 1}
_CODE = {name: code for code, (name, _) in SAFETENSORS.items()}


def dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name, without torch where the table knows it."""
    size = _ITEMSIZE.get(name.removeprefix("torch."))
    return size if size is not None else parse_dtype(name).itemsize


def known_name(name: str) -> str:
    """A dtype name without its "torch." prefix, checked: by the table where it knows the name (no torch), else
    by torch. ValueError for an unknown one."""
    bare = name.removeprefix("torch.")
    if bare not in _ITEMSIZE:
        parse_dtype(bare)
    return bare


@functools.cache
def parse_dtype(name: str):
    """The ``torch.dtype`` of a name ("bfloat16", "torch.float8_e4m3fn"); ValueError for an unknown one."""
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def from_safetensors(code: str):
    """The ``torch.dtype`` of a safetensors code; None where the code or this torch does not have it."""
    entry = SAFETENSORS.get(code)
    if entry is None:
        return None
    try:
        return parse_dtype(entry[0])
    except ValueError:
        return None


def safetensors_code(dtype) -> str:
    """The safetensors code of a dtype (KeyError for one safetensors cannot store)."""
    return _CODE[dtype_name(dtype)]
