"""A preload restarted as it ran before comes back from its record (``record.py``) without the engine: same
arguments and environment, unchanged checkpoint files, every cache still held by the custodian. The
supervisor and its daemons then import neither vLLM nor transformers nor torch, build no config, and each
daemon takes its rank's cache over from the custodian and serves it. Anything else, including a daemon that
finds its cache gone, takes the full path (the command runs again from the start, without this shortcut)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import msgspec

from ..argv import option_value
from ..key import CacheKey
from ..sources import FillSource
from . import record
from .child import EXIT_NOT_HELD, NotHeld

log = logging.getLogger("weightcache.supervisor")

ENV_OFF = "WEIGHTCACHE_NO_FAST_RESTART"


class HeldOnly(FillSource):
    """A rank whose cache must be taken over from the custodian: it has nothing to load from."""

    def __init__(self, placement):
        self.placement = placement

    def describe(self):
        raise NotHeld(f"rank {self.placement.rank}: the custodian no longer holds this cache")

    key_fields = fill = describe


def held_only(placement, **_) -> HeldOnly:
    return HeldOnly(placement)


def recorded_key(source, placement, *, layout: str, role: str, keys: dict) -> CacheKey:
    return msgspec.convert(keys[str(placement.rank)], CacheKey)


def socket_dir_of(argv: list[str]) -> Path:
    from ..sockets import default_socket_dir_path

    explicit = option_value(argv, "--weight-cache-socket-dir")
    return Path(explicit) if explicit else default_socket_dir_path()


def usable_record(argv: list[str]) -> record.Record | None:
    """This preload's record, if it may be restarted from: unchanged files, every cache held."""
    if os.environ.get(ENV_OFF) or {"-h", "--help", "--weight-cache-no-custodian"} & set(argv):
        return None
    socket_dir = socket_dir_of(argv)
    rec = record.read(socket_dir, record.record_id(argv))
    if rec is None:
        return None
    stale = rec.stale_stamps()
    if stale:
        _say(f"the checkpoint changed since this preload last ran ({stale[0]}): loading it again")
        record.remove(socket_dir, rec.rid)
        return None
    from ..custodian.client import CustodianClient
    from ..errors import WeightCacheError

    try:
        client = CustodianClient.connect(socket_dir, client=f"restart pid {os.getpid()}", timeout=5.0)
        try:
            held = {h.name for h in client.holdings().holdings}
        finally:
            client.close()
    except WeightCacheError:
        return None
    missing = rec.names() - held
    if missing:
        _say(f"the custodian no longer holds {sorted(missing)[0]}: loading again")
        return None
    return rec


def _say(line: str) -> None:
    """One line before logging is set up (the full path sets it up its own way)."""
    print(f"weightcache preload: {line}", file=sys.stderr, flush=True)


def groups_of(rec: record.Record) -> list:
    from .group import Group

    groups = []
    for g in rec.groups:
        groups.append(Group(
            role=g["role"], layout=record.layout_from(g["layout"]), make_source=held_only,
            make_key=recorded_key, key_args={"keys": {str(r["rank"]): r["key"] for r in g["ranks"]}},
            master_addr=g["master_addr"], master_port=g["master_port"], info=dict(g["info"]),
            loads_alone=False, gpu_uuids={r["rank"]: r["gpu_uuid"] for r in g["ranks"] if r.get("gpu_uuid")}))
    return groups


def restart(argv: list[str]) -> int | None:
    """Run the preload ``argv`` from its record; None where it must take the full path."""
    rec = usable_record(argv)
    if rec is None:
        return None
    from .options import configure_logging
    from .supervisor import StartError, Supervisor

    opts = rec.options
    configure_logging(logging.getLevelName(opts.get("log_level", logging.INFO)))
    log.info("restarting from %s: the custodian holds every cache; no engine is imported",
             record.record_path(rec.socket_dir, rec.rid).name)
    groups = groups_of(rec)
    try:
        sup = Supervisor(groups, socket_dir=rec.socket_dir, health_host=opts.get("health_host", "127.0.0.1"),
                         health_port=opts.get("health_port"), start_timeout=opts.get("start_timeout", 3600.0),
                         rendezvous_timeout=opts.get("rendezvous_timeout", 600.0),
                         log_level=opts.get("log_level", logging.INFO),
                         keep_on_stop=opts.get("keep_on_stop", False),
                         **({"hold_after_exit": opts["hold_after_exit"]} if "hold_after_exit" in opts else {}),
                         scrub_interval=opts.get("scrub_interval", 0.0),
                         status_details=opts.get("status_details", False),
                         warm_engine=opts.get("warm_engine", False), warm_models=opts.get("warm_models", []),
                         remember={"argv": rec.argv, "checkpoints": rec.checkpoints, "stamps": rec.stamps},
                         local_rendezvous=True)
    except StartError as e:
        log.info("cannot restart from the record (%s): loading again", e)
        return None
    code = sup.run()
    if not sup.ready and not sup.stopped_by_signal:  # the record did not hold: the full path decides
        record.remove(rec.socket_dir, rec.rid)
        why = "a cache was gone when its daemon came for it" if code == EXIT_NOT_HELD else "the restart failed"
        log.warning("%s: starting again in full", why)
        full_start(argv)
    return code


def full_start(argv: list[str]) -> None:
    """Run this preload again from the start, without the shortcut (replaces this process)."""
    os.environ[ENV_OFF] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "weightcache.cli", "preload", *argv])
