"""Exportable memory: blocks a daemon owns and a client imports by file descriptor."""

from __future__ import annotations

import torch

from .host import HostBlock, import_host_blocks


def allocate_block(nbytes: int, device: torch.device):
    if device.type == "cpu":
        return HostBlock(nbytes)
    if device.type == "cuda":
        from .cuda import CudaBlock

        return CudaBlock(nbytes, device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"unsupported arena device {device}")


def import_blocks(fds: list[int], sizes: list[int], device: torch.device, readonly: bool) -> list[torch.Tensor]:
    if device.type == "cpu":
        return import_host_blocks(fds, sizes, readonly)
    from .cuda import import_cuda_blocks

    return import_cuda_blocks(fds, sizes, device.index, readonly)


__all__ = ["HostBlock", "allocate_block", "import_blocks"]
