"""What every `weightcache preload` front end shares (``frontend`` for the transformers and safetensors engines,
``vllm_frontend`` for vLLM's own flags): the ``--weight-cache-*`` flags, defined here once, their argument
types, logging, the socket directory and running the supervisor."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from .custody import DEFAULT_HOLD_AFTER_EXIT_S

DEFAULT_HEALTH_HOST = "127.0.0.1"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2."""


def int_in(low: int, high: int | None, what: str):
    """An argparse type: an integer in [low, high], named `what` in its errors."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if high is not None and not low <= v <= high:
            raise argparse.ArgumentTypeError(f"port {v} is outside {low}..{high}")
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v

    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite, positive number of seconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0")
    return v


def seconds_or_zero(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds >= 0")
    return v


port_number = int_in(1, 65535, "a port number")
port_or_zero = int_in(0, 65535, "a port number")
positive_int = int_in(1, None, "an integer")
non_negative_int = int_in(0, None, "an integer")


def add_weight_cache_arguments(p: argparse.ArgumentParser, *, vllm: bool = False) -> None:
    """The ``--weight-cache-*`` flags of every preload front end. ``vllm``: the front end takes vLLM's own
    flags (its log level is then ``--weight-cache-log-level``, and several-nodes-on-one-host testing is
    vLLM's own business)."""
    g = p.add_argument_group("weight cache")
    g.add_argument("--weight-cache-socket-dir", default=None, metavar="DIR",
                   help="where the daemons' sockets live (default: a per-user 0700 directory)"
                        + ("; pass the same directory to the engine as --model-loader-extra-config "
                           "'{\"socket_dir\": DIR}'" if vllm else ""))
    g.add_argument("--weight-cache-master-port", type=port_number, default=None, metavar="PORT",
                   help="rendezvous port of the main group on node 0 (required across nodes; else free)"
                        + ("; not the engine's --master-port" if vllm else ""))
    g.add_argument("--weight-cache-draft-master-port", type=port_number, default=None, metavar="PORT",
                   help="rendezvous port of the draft group (default: master port + 1 across nodes; else "
                        "free); must differ from the main one")
    g.add_argument("--weight-cache-health-port", type=port_or_zero, default=None, metavar="PORT",
                   help="serve /health, /metrics and /status on this port (off by default; 0: a free port)")
    g.add_argument("--weight-cache-health-host", default=DEFAULT_HEALTH_HOST, metavar="HOST",
                   help=f"address the HTTP server binds (default {DEFAULT_HEALTH_HOST})")
    g.add_argument("--weight-cache-status-details", action="store_true",
                   help="/status and /metrics also show process ids, socket paths and whole model paths (any "
                        "local user can read the health port; allowed with a loopback health host only)")
    g.add_argument("--weight-cache-start-timeout", type=seconds, default=3600.0, metavar="S",
                   help="give up if the daemons are not ready after this long")
    g.add_argument("--weight-cache-rendezvous-timeout", type=seconds, default=600.0, metavar="S",
                   help="how long nodes wait for each other")
    if not vllm:
        g.add_argument("--weight-cache-allow-loopback-nodes", action="store_true",
                       help="let several 'nodes' share one host over loopback (testing)")
    g.add_argument("--weight-cache-keep-on-stop", action="store_true",
                   help="on SIGINT/SIGTERM leave the weights with the custodian, for the next preload of the "
                        "same model and flags (an upgrade); `weightcache release` frees them")
    g.add_argument("--weight-cache-hold-after-exit", type=seconds_or_zero, default=DEFAULT_HOLD_AFTER_EXIT_S,
                   metavar="S", help="how long the custodian keeps the weights of a preload that is gone without "
                   f"an orderly stop (killed, crashed), for its next start (default {DEFAULT_HOLD_AFTER_EXIT_S:.0f}; "
                   "0: free them at once); `weightcache release` frees them earlier")
    g.add_argument("--weight-cache-scrub-interval", type=seconds, default=None, metavar="S",
                   help="every S seconds each daemon re-hashes its resident weights against the digests recorded "
                        "at load, at low priority; a change is logged, shown in status and /metrics, makes /health "
                        "503 and refuses new attaches (default: off; `weightcache verify` checks on demand)")
    g.add_argument("--weight-cache-no-custodian", action="store_true",
                   help="no custodian: the weights live and die with their daemons")
    g.add_argument("--warm-engine", "--weight-cache-warm-engine", dest="weight_cache_warm_engine",
                   action="store_true",
                   help="also keep an interpreter with torch, vLLM and transformers imported, from which "
                        "`weightcache run -- vllm serve ...` starts engines without paying the imports")
    g.add_argument("--weight-cache-log-level" if vllm else "--log-level", dest="log_level", default="INFO",
                   choices=LOG_LEVELS)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [supervisor] %(name)s: %(message)s")


def resolve_socket_dir(explicit: str | None, roles: list[str], world_size: int, device: str,
                       create: bool = True) -> Path:
    """The socket directory: socket paths short enough for every rank (checked before the directory is
    made), ours, private and writable (not on a read-only filesystem). Without `create`, an existing
    directory is checked and a missing one left alone."""
    from ..errors import WeightCacheError
    from ..sockets import check_socket_path, default_socket_dir_path, ensure_private_dir, longest_socket_path

    path = Path(explicit) if explicit else default_socket_dir_path()
    try:
        check_socket_path(longest_socket_path(path, roles, world_size, device))
        if not create and not path.exists():
            return path
        return ensure_private_dir(path)
    except WeightCacheError as e:
        raise UsageError(f"{e}" + (" (--weight-cache-socket-dir)" if explicit else "")) from None


def run_supervisor(groups, socket_dir, args, *, argv: list[str] | None = None, checkpoints=(), digests=()) -> int:
    """Run the daemon groups with the --weight-cache-* options every preload front end shares. ``argv`` and
    ``checkpoints``: the preload's command line and checkpoint directories, remembered once READY for a
    restart that needs no engine (``record.py``). ``digests``: (what, Future) of checkpoint hashes started by
    the front end; the start fails in one line if one does."""
    from .layout import is_loopback
    from .record import checkpoint_stamps
    from .supervisor import StartError, Supervisor

    details = args.weight_cache_status_details
    if details and not is_loopback(args.weight_cache_health_host):
        raise UsageError(f"--weight-cache-status-details shows process ids and paths: allowed only with a loopback "
                         f"--weight-cache-health-host, not {args.weight_cache_health_host}")

    remember = None
    if argv is not None and not args.weight_cache_no_custodian:
        try:
            remember = {"argv": list(argv), "checkpoints": [str(Path(c).resolve()) for c in checkpoints],
                        "stamps": checkpoint_stamps(checkpoints)}
        except OSError:
            remember = None
    try:
        sup = Supervisor(groups, socket_dir=socket_dir, health_host=args.weight_cache_health_host,
                         status_details=details,
                         health_port=args.weight_cache_health_port,
                         start_timeout=args.weight_cache_start_timeout,
                         rendezvous_timeout=args.weight_cache_rendezvous_timeout,
                         log_level=getattr(logging, args.log_level),
                         custodian=not args.weight_cache_no_custodian,
                         keep_on_stop=args.weight_cache_keep_on_stop, remember=remember,
                         digests=list(digests), hold_after_exit=args.weight_cache_hold_after_exit,
                         scrub_interval=args.weight_cache_scrub_interval or 0.0,
                         warm_engine=getattr(args, "weight_cache_warm_engine", False),
                         warm_models=[str(Path(c).resolve()) for c in checkpoints])
    except StartError as e:
        raise UsageError(str(e)) from None
    return sup.run()
