"""`preload --warm-engine`: the supervisor's handle on the warm engine interpreter of its socket directory.

It reuses a live one that would accept this interpreter and environment, retires one that would not, and
otherwise starts one in its own session (it must outlive a SIGKILLed preload: engines started from it are its
children), with the environment this process started with (its imports may have changed os.environ). It does
not wait for the imports: until the warm interpreter is ready, `weightcache run` starts engines normally.
An orderly stop retires it (it exits once its engines have), unless the weights are kept past the preload.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

from ..errors import WeightCacheError
from ..sockets import probe, warm_socket_path
from .identity import initial_environ

log = logging.getLogger("weightcache.warm.service")
LOG_NAME = "warm.log"  # in the socket directory: what the warm interpreter says


class WarmService:
    def __init__(self, socket_dir: str | Path, imports: list[str] | None = None, models: list[str] = ()):
        self.socket_dir = Path(socket_dir)
        self.imports = imports  # None: the warm interpreter's defaults
        self.models = list(models)  # model directories whose architecture's modules it imports too
        self.path = warm_socket_path(self.socket_dir)
        self.proc: subprocess.Popen | None = None
        self.reused_pid = 0

    def start(self) -> None:
        from . import client

        env = initial_environ()
        if probe(self.path) == "live":
            try:
                why = client.check(self.path, sys.executable, env)
                if not why:
                    self.reused_pid = client.query(self.path).pid
                    log.info("warm engine interpreter pid %d at %s is reused", self.reused_pid, self.path)
                    return
                log.info("the warm engine interpreter at %s does not fit (%s): retiring it", self.path, why)
                client.retire(self.path)
            except WeightCacheError as e:
                log.warning("warm engine interpreter at %s: %s; starting another", self.path, e)
        argv = [sys.executable, "-m", "weightcache.cli", "warm-engine", "--socket-dir", str(self.socket_dir)]
        for name in self.imports or ():
            argv += ["--import", name]
        for model in self.models:
            argv += ["--model", model]
        with open(self.socket_dir / LOG_NAME, "ab") as logf:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True, close_fds=True)
        log.info("warm engine interpreter pid %d is importing (log: %s); `weightcache run -- vllm serve ...` "
                 "starts engines from it once it is ready", self.proc.pid, self.socket_dir / LOG_NAME)

    def stop(self, keep: bool = False) -> None:
        from . import client

        if keep:
            log.info("the warm engine interpreter at %s is kept", self.path)
        else:
            try:
                running = client.retire(self.path)
                log.info("warm engine interpreter retired%s", f"; it exits once its {running} engine(s) exit"
                         if running else "")
            except WeightCacheError:
                if self.proc is not None and self.proc.poll() is None:  # still importing: nothing runs from it
                    self.proc.terminate()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.5)  # reaped if it is gone; left to run out otherwise

    def info(self) -> dict:
        return {"socket": str(self.path), "up": probe(self.path) == "live",
                "pid": self.proc.pid if self.proc is not None else self.reused_pid}
