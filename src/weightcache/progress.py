"""Progress of a long byte count: a tqdm bar on a TTY, log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import threading
import time


class Progress:
    """A tqdm bar (bytes, rate, ETA) on a TTY, otherwise a log line on `logger` every few seconds; `update`
    may be called from several threads."""

    def __init__(self, total: int, label: str, enabled: bool, logger: logging.Logger, interval: float = 5.0):
        self.total, self.label, self.interval, self.log = total, label, interval, logger
        self.done = 0
        self._lock = threading.Lock()
        self.t0 = self.last = time.monotonic()
        self.bar = None
        self.enabled = enabled and total > 0
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(  # the rate shown is the average since the start (smoothing=0), in GB/s
                total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, dynamic_ncols=True,
                smoothing=0,
            )

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            if not self.enabled:
                return
            if self.bar is not None:
                self.bar.update(n)
                return
            now = time.monotonic()
            if now - self.last < self.interval:
                return
            self.last = now
        self._log(now)

    def _log(self, now: float) -> None:
        dt = max(now - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        self.log.info(
            "%s: %.2f / %.2f GB (%.0f%%), %.2f GB/s, ETA %.0fs",
            self.label, self.done / 1e9, self.total / 1e9, 100.0 * self.done / self.total, rate / 1e9, eta,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._log(time.monotonic())


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(max(0, s))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"
