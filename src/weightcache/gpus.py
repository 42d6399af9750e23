"""Devices without torch: where a daemon's memory lives (DeviceSpec), and which GPU a device index is, by
its UUID from the CUDA driver (NVIDIA's cuda-bindings) in the form torch gives it
(``torch.cuda.get_device_properties(i).uuid``). Indices change with CUDA_VISIBLE_DEVICES; UUIDs do not."""

from __future__ import annotations

import uuid
from typing import NamedTuple


def uuid_text(raw: bytes) -> str:
    """The 16 bytes of a CUDA UUID as torch prints them (8-4-4-4-12 lowercase hex)."""
    return str(uuid.UUID(bytes=bytes(raw)))


def _driver():
    """NVIDIA's driver bindings, initialised: (module, None); (None, "missing") without cuda-bindings, (None,
    "no driver") where cuInit fails (no driver or no device)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None, "missing"
    (err,) = cu.cuInit(0)
    return (cu, None) if err == cu.CUresult.CUDA_SUCCESS else (None, "no driver")


def uuid_of(index: int) -> str | None:
    """The UUID of visible device ``index``; None where the driver or cuda-bindings cannot say."""
    try:
        cu, _ = _driver()
        if cu is None:
            return None
        err, dev = cu.cuDeviceGet(index)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        get = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        err, got = get(dev)
        return uuid_text(got.bytes) if err == cu.CUresult.CUDA_SUCCESS else None
    except Exception:  # noqa: BLE001 - an unexpected bindings API: unknown, not an error
        return None


def cuda_device_count() -> int | None:
    """How many CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies), from the driver: 0 without a
    driver or device; None where cuda-bindings is missing (ask torch then)."""
    try:
        cu, why = _driver()
        if cu is None:
            return None if why == "missing" else 0
        err, count = cu.cuDeviceGetCount()
        return int(count) if err == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:  # noqa: BLE001 - an unexpected bindings API: ask torch
        return None


class DeviceSpec(NamedTuple):
    """Where a daemon's memory lives, without torch: "cpu" or ("cuda", index)."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @classmethod
    def of(cls, device) -> DeviceSpec:
        if hasattr(device, "type"):  # a torch.device
            spec = cls(device.type, device.index)
        else:
            kind, _, index = str(device).partition(":")
            spec = cls(kind, int(index) if index else None)
        if spec.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported daemon device {device!r} (cpu or cuda[:N])")
        if spec.type == "cuda" and spec.index is None:
            import torch

            spec = cls("cuda", torch.cuda.current_device())
        return spec if spec.type == "cuda" else cls("cpu")

    def torch(self):
        import torch

        return torch.device(str(self))
