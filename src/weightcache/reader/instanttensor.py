"""InstantTensor as the reader of a SafetensorsSource (``io="instanttensor"``, optional extra).

InstantTensor (``pip install instanttensor``) reads all the checkpoint's files in one call into a ring
buffer in device memory, through the page-cache mapping (tmpfs), io_uring/AIO with O_DIRECT (disk) or
cuFile. In its zero-copy mode (``copy=False``) it yields views of that ring buffer; each one is copied
(sharded, cast) into the arena view on the current stream, which InstantTensor synchronizes before it
reuses the buffer. It reads whole tensors: a tensor-parallel rank reads every byte of a split tensor.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Mapping

import torch

from .reading import CheckpointError


def available() -> bool:
    """InstantTensor is importable here (it needs CUDA; ``auto`` uses it only then)."""
    try:
        return importlib.util.find_spec("instanttensor") is not None
    except (ImportError, ValueError):
        return False


def shard_of(full: torch.Tensor, t, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of a whole tensor under the source's shard spec (packed parts concatenated)."""
    if t.spec.replicated or tp_size == 1 or full.dim() == 0:
        return full
    d = t.spec.dim
    parts = [full.narrow(d, a, b - a) for a, b in t.spec.ranges(tuple(full.shape), tp_rank, tp_size)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, d)


def fill_with_instanttensor(source, views: Mapping[str, torch.Tensor], report: Callable[[int], None],
                            **options) -> None:
    try:
        from instanttensor import safe_open
    except ImportError as e:
        raise CheckpointError(f"io='instanttensor' needs the InstantTensor package (pip install instanttensor): {e}"
                              ) from None
    files = source.files_without_duplicates()
    device = next(v.device for v in views.values())
    index = device.index if device.index is not None else torch.cuda.current_device()
    done: set[str] = set()
    with torch.cuda.device(index), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # copy=False with a ring buffer smaller than the model: intended
        try:
            with safe_open([str(f) for f in files], framework="pt", device=index, copy=False,
                           tensor_filter=list(source.tensors), tensor_name_match_mode="exact", **options) as f:
                for name, full in f.tensors():
                    t = source.tensors.get(name)
                    if t is None:
                        continue
                    views[name].copy_(shard_of(full, t, source.tp_rank, source.tp_size))
                    done.add(name)
                    report(t.out_nbytes)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"InstantTensor failed to read {source.model_dir}: {type(e).__name__}: {e}") from e
    missing = set(source.tensors) - done
    if missing:
        raise CheckpointError(f"InstantTensor yielded no data for {len(missing)} tensor(s), e.g. {min(missing)!r}")


__all__ = ["available", "fill_with_instanttensor", "shard_of"]
