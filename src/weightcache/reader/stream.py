"""A checkpoint's tensors streamed onto one device for an engine's own loader: read by the fast fill a batch at a
time, ahead of the consumer, each tensor into an allocation of its own that becomes the consumer's (a parameter,
or the source of its copy or conversion). Memory stays bounded: at most ``ahead`` batches are read and not yet
consumed; a tensor asked for after its batch was retired (consumed out of order, or skipped) is read again on
its own. The consumer asks in any order (``take``) or iterates in the stream's order."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .header import CheckpointEntry
from .read_plan import Piece, ReadPlan
from .reading import CheckpointError
from .settings import ReadSettings

log = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 512 << 20
DEFAULT_AHEAD = 2


def batches_of(names: list[str], entries: Mapping[str, CheckpointEntry], batch_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into batches of at most ``batch_bytes`` (a larger tensor is a batch alone)."""
    out: list[list[str]] = []
    size = 0
    for n in names:
        nbytes = entries[n].nbytes
        if not out or (size + nbytes > batch_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(n)
        size += nbytes
    return out


class CheckpointStream:
    """Tensors ``order`` of ``entries`` (safetensors entries: file, offset, dtype, shape) onto ``device``."""

    def __init__(self, entries: Mapping[str, CheckpointEntry], order: list[str], device: torch.device | str,
                 settings: ReadSettings, *, batch_bytes: int = DEFAULT_BATCH_BYTES, ahead: int = DEFAULT_AHEAD,
                 report=None):
        unknown = [n for n in order if n not in entries]
        if unknown:
            raise CheckpointError(f"no tensor {unknown[0]!r} in the checkpoint")
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self.entries, self.order = entries, list(order)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.settings = settings
        self.batches = batches_of(self.order, entries, batch_bytes)
        self.batch_of = {n: i for i, b in enumerate(self.batches) for n in b}
        self.ahead = ahead
        self.report = report or (lambda n: None)
        self.nbytes = sum(entries[n].nbytes for n in self.order)
        self.reread = 0  # tensors read again on their own (asked for after their batch was retired)
        # seconds: the reader allocating and filling, and the consumer waiting for it (they overlap otherwise;
        # consumers on several threads count once while any of them waits)
        self.timings = {"allocate": 0.0, "read": 0.0, "consumer waited": 0.0}
        self._waiting = 0
        self._wait_began = 0.0
        self._ready: dict[str, torch.Tensor] = {}
        self._left: list[int] = [len(b) for b in self.batches]  # per batch: tensors not yet taken
        self._taken: set[str] = set()
        self._read_to = 0  # batches read: [0, _read_to)
        self._retired_to = 0  # batches whose untaken tensors were dropped: [0, _retired_to)
        self._demand = 0  # the reader reads at least up to this batch (a consumer waits on it)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._session = None
        self._consumer_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._read_loop, name="wc-stream", daemon=True)
        self._thread.start()

    # -- the consumer's side

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name``, once (it is the caller's from now on)."""
        with self._cond:
            if name in self._taken:
                raise CheckpointError(f"tensor {name!r} was already taken from the stream")
            b = self.batch_of.get(name)
            if b is None:
                raise CheckpointError(f"tensor {name!r} is not in this stream")
            if b < self._retired_to and name not in self._ready:
                self._taken.add(name)
                late = True
            else:
                late = False
                self._demand = max(self._demand, b + 1)
                self._cond.notify_all()
                if name not in self._ready:
                    self._begin_wait()
                    try:
                        while name not in self._ready:
                            if self._error is not None:
                                raise CheckpointError(f"reading the checkpoint failed: {self._error}") \
                                    from self._error
                            if self._stop:
                                raise CheckpointError("the checkpoint stream is closed")
                            self._cond.wait(0.5)
                    finally:
                        self._end_wait()
                t = self._ready.pop(name)
                self._taken.add(name)
                self._left[b] -= 1
                self._retire_behind(b)
                self._cond.notify_all()
        if late:
            self.reread += 1
            t = self._read_alone(name)
        return t

    def _begin_wait(self) -> None:  # under the lock
        if self._waiting == 0:
            self._wait_began = time.perf_counter()
        self._waiting += 1

    def _end_wait(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self.timings["consumer waited"] += time.perf_counter() - self._wait_began

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.order:
            if name not in self._taken:
                yield name, self.take(name)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join()
        if self.reread:
            log.info("%d tensor(s) were asked for after their batch had gone by and were read again on their own",
                     self.reread)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _retire_behind(self, b: int) -> None:
        """Batches ``ahead`` or more behind the one the consumer takes from now, and fully taken batches at
        the front, are done: their untaken tensors (skipped by the consumer) are dropped."""
        while self._retired_to < self._read_to and (self._left[self._retired_to] == 0
                                                     or self._retired_to + self.ahead <= b):
            for n in self.batches[self._retired_to]:
                self._ready.pop(n, None)
            self._retired_to += 1

    # -- the reader's side

    def _read_loop(self) -> None:
        try:
            self._open()
            for b in range(len(self.batches)):
                with self._cond:
                    while not self._stop and b >= max(self._retired_to + self.ahead, self._demand):
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                got = self._read([n for n in self.batches[b] if n not in self._taken])
                with self._cond:
                    if self._stop:
                        return
                    self._ready.update(got)
                    self._read_to = b + 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            self._close_session()

    def _plan(self, names: list[str]) -> tuple[ReadPlan, dict[str, torch.Tensor]]:
        views, pieces = {}, []
        for n in names:
            e = self.entries[n]
            views[n] = torch.empty(e.shape, dtype=e.dtype, device=self.device)
            pieces.append(Piece(e.file, e.start, e.nbytes, n, 0))
        return ReadPlan(pieces), views

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        plan, views = self._plan(names)
        t1 = time.perf_counter()
        if self.device.type == "cuda":
            # memory the consumer freed may still be read by its queued copies: wait for them
            self._consumer_stream.synchronize()
            self._session.fill(plan, views, self.report)
        else:
            from .cpu_fill import CpuFill

            CpuFill(plan, self.settings, views, self.report).run()
        self.timings["allocate"] += t1 - t0
        self.timings["read"] += time.perf_counter() - t1
        return views

    def _read_alone(self, name: str) -> torch.Tensor:
        plan, views = self._plan([name])
        if self.device.type == "cuda":
            from .cuda_fill import CudaFill

            CudaFill(plan, self.settings, views, lambda n: None, device=self.device).run()
        else:
            from .cpu_fill import CpuFill

            CpuFill(plan, self.settings, views, lambda n: None).run()
        return views[name]

    def _open(self) -> None:
        if self.device.type != "cuda":
            return
        from .cuda_fill import CudaFill
        from .staging import prepare_windows

        files: set[Path] = {self.entries[n].file for n in self.order}
        self._session = CudaFill(None, self.settings, {}, self.report, device=self.device, files=files,
                                 prepared=prepare_windows(self.settings, self.device.index))
        self._session.open()

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
