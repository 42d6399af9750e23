"""Device memory a daemon uses while it loads: sampled every few ms from the start of the load (CUDA), above
what was in use just before it. What the daemon reports as its peak."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class PeakWatch:
    def __init__(self, device_index: int, loading: Callable[[], bool]):
        import torch

        self.index, self.loading = device_index, loading
        self._mem_get_info = torch.cuda.mem_get_info
        free, total = self._mem_get_info(device_index)
        self.baseline, self.peak = total - free, 0
        threading.Thread(target=self._run, name="weightcache-peak", daemon=True).start()

    def sample(self) -> None:
        free, total = self._mem_get_info(self.index)
        self.peak = max(self.peak, total - free - self.baseline)

    def _run(self) -> None:
        while self.loading():
            self.sample()
            time.sleep(0.01)
        self.sample()
