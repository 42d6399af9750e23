"""Cache identity: what weights a daemon holds, checked field by field before any attach."""

from __future__ import annotations

import hashlib
import logging

import msgspec

from .errors import KeyMismatch

log = logging.getLogger(__name__)

# 2: content digests are BLAKE3 trees over 16 MiB chunks (digests.py), no longer SHA-256
# 3: the short hash (socket names) encodes `extra` in sorted order, whoever built the key
ABI_VERSION = 3
_CANONICAL = msgspec.msgpack.Encoder(order="deterministic")


class CacheKey(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    content_digest: str
    revision: str = ""
    dtype: str = ""
    quantization: str = "none"
    layout: str = "dp1-pp1-tp1"
    rank: int = 0
    role: str = "main"
    engine: str = "torch"
    engine_version: str = ""
    abi: int = ABI_VERSION
    extra: dict[str, str] = {}

    def short_hash(self) -> str:
        return hashlib.sha256(_CANONICAL.encode(self)).hexdigest()[:12]

    def replace(self, **changes) -> CacheKey:
        return msgspec.structs.replace(self, **changes)


class FieldDiff(msgspec.Struct, frozen=True):
    field: str
    expected: str
    actual: str


def diff(expected: CacheKey, actual: CacheKey) -> list[FieldDiff]:
    out = []
    for name in expected.__struct_fields__:
        a, b = getattr(expected, name), getattr(actual, name)
        if name == "extra":
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(FieldDiff(f"extra.{k}", str(a.get(k, "")), str(b.get(k, ""))))
        elif a != b:
            out.append(FieldDiff(name, str(a), str(b)))
    return out


def check(expected: CacheKey, actual: CacheKey, socket: str = "") -> None:
    diffs = diff(expected, actual)
    if diffs:
        raise KeyMismatch(diffs, socket)


