"""transformers' own loading fed by weightcache's reader: the checkpoint's tensors reach ``_load_pretrained_model``
as lazy slices (what safetensors' ``get_slice`` gives it) over a ``CheckpointStream``, so each tensor is read by the
fast fill straight into device memory that becomes the parameter; renames, fused experts, quantizers and TP
sharding stay transformers'. transformers' allocator warm-up (one segment the size of the model) is skipped: a
parameter freed while the daemon packs must go back to the device, not stay cached in a shared segment."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import torch

from ...dtypes import safetensors_code
from ...reader.header import read_header
from ...reader.settings import ReadSettings
from ...reader.stream import CheckpointStream

log = logging.getLogger("weightcache.integrations.transformers.producer")

_held = threading.local()  # per loading thread: the last whole tensor sliced (TP reads several slices of one)


class StreamedSlice:
    """One checkpoint tensor as transformers' loading sees a safetensors slice: shape and dtype known, bytes
    read when it is indexed (``t[...]`` for the whole tensor, ``t[slices]`` for a shard of it)."""

    def __init__(self, stream: CheckpointStream, name: str):
        self.stream, self.name = stream, name
        entry = stream.entries[name]
        self.shape, self.dtype = torch.Size(entry.shape), entry.dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return safetensors_code(self.dtype)

    def _whole(self) -> torch.Tensor:
        held = getattr(_held, "slot", None)
        if held is not None and held[0] is self:
            return held[1]
        return self.stream.take(self.name)

    def __getitem__(self, index) -> torch.Tensor:
        if index is Ellipsis or index == (Ellipsis,):
            return self._whole()
        whole = self._whole()
        _held.slot = (self, whole)  # a strided shard is cut in several slices of the same tensor
        part = whole[index]
        if part.untyped_storage().nbytes() > part.numel() * part.element_size():
            part = part.clone()  # a shard must not keep the whole tensor alive
        return part


def checkpoint_entries(files: list[str]) -> dict:
    """Every tensor of these safetensors files (a name in two files: the later one, as transformers reads)."""
    entries = {}
    for f in files:
        entries.update(read_header(Path(f))[0])
    return entries


def natural_order(names) -> list[str]:
    """The order transformers' loading visits the checkpoint's keys in (its own sort, where it has one)."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return list(names)
    return sorted(names, key=dot_natural_key)


@contextlib.contextmanager
def no_allocator_warmup():
    """Skip transformers' caching-allocator warm-up during the daemon's load (see the module's docstring)."""
    import transformers.modeling_utils as mu

    saved = getattr(mu, "caching_allocator_warmup", None)
    if saved is None:
        yield
        return
    mu.caching_allocator_warmup = lambda *a, **k: None
    try:
        yield
    finally:
        mu.caching_allocator_warmup = saved


def streamed_state_dict(files: list[str], device: torch.device, settings: ReadSettings, report=None
                        ) -> tuple[dict[str, StreamedSlice], CheckpointStream] | None:
    """The lazy state dict over these files and the stream behind it; None where the reader cannot read them
    (not all safetensors), with one warning line saying why."""
    others = [f for f in files if not str(f).endswith(".safetensors")]
    if others:
        log.warning("%s is not safetensors: transformers reads this checkpoint itself (slower)", Path(others[0]).name)
        return None
    entries = checkpoint_entries(files)
    stream = CheckpointStream(entries, natural_order(entries), device, settings, report=report)
    return {n: StreamedSlice(stream, n) for n in stream.order}, stream


def release_held() -> None:
    _held.slot = None
