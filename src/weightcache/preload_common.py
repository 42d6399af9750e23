"""What every `weightcache preload` front end shares (the built-in one in ``cli`` and vLLM's in
``vllm_preload``): argument types, the custodian's flags, logging, the socket directory and running the
supervisor."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_HEALTH_HOST = "127.0.0.1"


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2."""


def _int_in(low: int, high: int | None, what: str):
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


_port = _int_in(1, 65535, "a port number")
_port_or_zero = _int_in(0, 65535, "a port number")
_positive = _int_in(1, None, "an integer")
_non_negative = _int_in(0, None, "an integer")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [supervisor] %(name)s: %(message)s")


def add_custodian_arguments(group) -> None:
    """The custodian's preload flags (shared by every preload front end)."""
    group.add_argument("--weight-cache-keep-on-stop", action="store_true",
                       help="on SIGINT/SIGTERM leave the weights with the custodian, for the next preload of the "
                            "same model and flags (an upgrade); `weightcache release` frees them")
    group.add_argument("--weight-cache-no-custodian", action="store_true",
                       help="no custodian: the weights live and die with their daemons")


def _socket_dir(explicit: str | None, roles: list[str], world_size: int, device: str, create: bool = True) -> Path:
    """The socket directory: socket paths short enough for every rank (checked before the directory is
    made), ours, private and writable (not on a read-only filesystem). Without `create`, an existing
    directory is checked and a missing one left alone."""
    from .errors import WeightCacheError
    from .naming import check_socket_path, default_socket_dir_path, ensure_private_dir, longest_socket_path

    path = Path(explicit) if explicit else default_socket_dir_path()
    try:
        check_socket_path(longest_socket_path(path, roles, world_size, device))
        if not create and not path.exists():
            return path
        return ensure_private_dir(path)
    except WeightCacheError as e:
        raise UsageError(f"{e}" + (" (--weight-cache-socket-dir)" if explicit else "")) from None


def run_supervisor(groups, socket_dir, args, log_level: str) -> int:
    """Run the daemon groups with the --weight-cache-* options every preload front end shares."""
    from .supervisor import StartError, Supervisor

    try:
        sup = Supervisor(groups, socket_dir=socket_dir, health_host=args.weight_cache_health_host,
                         health_port=args.weight_cache_health_port,
                         start_timeout=args.weight_cache_start_timeout,
                         rendezvous_timeout=args.weight_cache_rendezvous_timeout,
                         log_level=getattr(logging, log_level),
                         custodian=not getattr(args, "weight_cache_no_custodian", False),
                         keep_on_stop=getattr(args, "weight_cache_keep_on_stop", False))
    except StartError as e:
        raise UsageError(str(e)) from None
    return sup.run()
