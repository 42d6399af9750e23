"""How weights get into a daemon. A source describes what it will produce, then fills arena views in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ..manifest import TensorMeta


@runtime_checkable
class Source(Protocol):
    def describe(self) -> list[TensorMeta]: ...

    def fill(self, views: dict[str, torch.Tensor], progress: Callable[[int], None]) -> None: ...

    def key_fields(self) -> dict[str, str]: ...


__all__ = ["Source", "TensorMeta"]
