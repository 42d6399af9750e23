"""Exportable memory: blocks a daemon owns and a client imports by file descriptor (``host``: memfd, ``cuda``: CUDA
VMM, ``adopted``: a block taken over from the custodian, served from its fd). torch is imported on first use."""

from __future__ import annotations


def allocate_block(nbytes: int, device):
    if device.type == "cpu":
        from .host import HostBlock

        return HostBlock(nbytes)
    if device.type == "cuda":
        import torch

        from .cuda import CudaBlock

        return CudaBlock(nbytes, device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"unsupported arena device {device}")


def import_blocks(fds: list[int], sizes: list[int], device, readonly: bool) -> list:
    if device.type == "cpu":
        from .host import import_host_blocks

        return import_host_blocks(fds, sizes, readonly)
    from .cuda import import_cuda_blocks

    return import_cuda_blocks(fds, sizes, device.index, readonly)


def __getattr__(name):
    if name == "HostBlock":
        from .host import HostBlock

        return HostBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HostBlock", "allocate_block", "import_blocks"]
