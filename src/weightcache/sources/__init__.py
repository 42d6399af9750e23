"""How weights get into a daemon: two contracts.

* :class:`FillSource` says what it will produce before anything is allocated (``describe``), may start work
  that overlaps the arena's allocation (``prepare``), then writes each tensor straight into its slot in the
  arena (``fill``). The raw checkpoint (``sources/safetensors.py``, sharded by a TP plan) is one.
* :class:`Producer` builds the rank's tensors itself, with an engine's own loader (its conversions,
  quantization and post-processing, its parallel layout), and hands them to the daemon, which packs them into
  its arena block by block, freeing each as it goes (``TensorSink.load_tensors(..., consume=True)``). The
  transformers and vLLM producers live in ``weightcache.integrations``.

The daemon calls ``Daemon.load(fill_source)``; a preload's daemon process calls ``producer.produce(daemon)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from ..manifest import TensorMeta

if TYPE_CHECKING:
    import torch


class FillSource(ABC):
    @abstractmethod
    def describe(self) -> list[TensorMeta]:
        """Every tensor it will write: name, dtype, shape, role. Reads no data."""

    @abstractmethod
    def key_fields(self) -> dict[str, str]:
        """Its part of the cache key (model, content digest, dtype, ...)."""

    def prepare(self) -> None:  # noqa: B027 - optional, nothing to do by default
        """Start what can overlap the arena's allocation (staging buffers). Nothing by default."""

    @abstractmethod
    def fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None]) -> None:
        """Write every described tensor into its view; report bytes done through ``progress``."""

    def release(self) -> None:  # noqa: B027 - optional, nothing to do by default
        """Free what ``prepare`` made where no fill follows (the load failed before it)."""


class TensorSink(Protocol):
    """What a producer hands its tensors to (a Daemon)."""

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str] | None = None, *,
                     consume: bool = False, began: float | None = None) -> None: ...

    def fail(self, message: str) -> None: ...


class Producer(ABC):
    @abstractmethod
    def produce(self, sink: TensorSink) -> None:
        """Build the rank's tensors and hand them to ``sink`` (``load_tensors(..., consume=True)``); on an
        error, ``sink.fail(message)`` then raise."""


Source = FillSource  # the name of the fill contract before producers had one of their own

__all__ = ["FillSource", "Producer", "Source", "TensorMeta", "TensorSink"]
