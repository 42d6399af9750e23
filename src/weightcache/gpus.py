"""Which GPU a device index is, without torch: its UUID from the CUDA driver (NVIDIA's cuda-bindings), in the
form torch gives it (``torch.cuda.get_device_properties(i).uuid``). Indices change with CUDA_VISIBLE_DEVICES;
UUIDs do not."""

from __future__ import annotations

import uuid


def uuid_text(raw: bytes) -> str:
    """The 16 bytes of a CUDA UUID as torch prints them (8-4-4-4-12 lowercase hex)."""
    return str(uuid.UUID(bytes=bytes(raw)))


def uuid_of(index: int) -> str | None:
    """The UUID of visible device ``index``; None where the driver or cuda-bindings cannot say."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    try:
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        err, dev = cu.cuDeviceGet(index)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        get = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        err, got = get(dev)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return uuid_text(got.bytes)
    except Exception:  # noqa: BLE001 - an unexpected bindings API: unknown, not an error
        return None
