"""`weightcache preload | status | verify | release | run | warm-engine | demo`: the command line; each command's
work lives elsewhere (the preload front ends in ``weightcache.preload``, the warm start in ``weightcache.warm``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .preload.frontend import PRELOAD_DESCRIPTION, PRELOAD_EPILOG, add_preload_arguments, preload_main
from .preload.options import UsageError, seconds

log = logging.getLogger("weightcache.cli")

__all__ = ["UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightcache", description="Keep model weights resident in memory.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{preload,status,verify,release,run,warm-engine,demo}")
    add_preload_arguments(sub.add_parser(
        "preload", help="start a daemon per rank and keep the weights loaded", description=PRELOAD_DESCRIPTION,
        epilog=PRELOAD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))
    st = sub.add_parser("status", help="list the daemons in a socket directory")
    st.add_argument("--socket-dir", default=None, help="default: the per-user socket directory")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--timeout", type=seconds, default=2.0,
                    help="seconds to wait for each daemon and for the custodian")
    ver = sub.add_parser("verify", help="re-hash every daemon's resident weights against their recorded digests",
                         description="Ask every daemon in a socket directory to re-hash its resident bytes (on its "
                                     "own device) and compare them with the digests recorded when they were loaded. "
                                     "Exit status: 0 all match, 1 some tensors differ (named), 3 a daemon could "
                                     "not be verified.")
    ver.add_argument("--socket-dir", default=None, help="default: the per-user socket directory")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each daemon (default 300)")
    rel = sub.add_parser("release", help="free the weights the custodian holds past their daemons",
                         description="Free what the custodian of a socket directory holds (all of it, or the named "
                                     "caches or models). Daemons that run keep serving; the memory returns once no "
                                     "daemon or engine maps it. The custodian exits once it holds nothing.")
    rel.add_argument("names", nargs="*", metavar="NAME", help="cache names (as --list shows them)")
    rel.add_argument("--socket-dir", default=None, help="default: the per-user socket directory")
    rel.add_argument("--model", default=None, metavar="PATH", help="only the caches of this model")
    rel.add_argument("--list", action="store_true", help="list what is held; release nothing")
    rel.add_argument("--json", action="store_true", help="machine-readable output")
    rel.add_argument("--stop", action="store_true", help="release everything and stop the custodian now")
    rel.add_argument("--timeout", type=seconds, default=5.0, metavar="S",
                     help="seconds to wait for the custodian's answer (one that does not answer is an error)")
    sub.add_parser("run", help="start an engine from the warm interpreter: weightcache run -- CMD ARGS...",
                   add_help=False)
    sub.add_parser("warm-engine", help="keep an interpreter with torch, vLLM and transformers imported for `run`",
                   add_help=False)
    sub.add_parser("demo", help="a short end-to-end demonstration", add_help=False)
    return parser


# ----------------------------------------------------------------------------------------------- preload

# ------------------------------------------------------------------------------------------------ status

def _daemons_dir(args, command: str) -> tuple[Path | None, int]:
    """The socket directory `status` and `verify` read: (it, 0); or (None, exit code) once said why not (no
    default directory yet is no daemon, not an error)."""
    from .errors import WeightCacheError
    from .sockets import check_private_dir, default_socket_dir_path

    socket_dir = Path(args.socket_dir) if args.socket_dir else default_socket_dir_path()
    if not socket_dir.is_dir():
        if not args.socket_dir:
            print(f"no weight cache daemons ({socket_dir} does not exist)")
            return None, 0
        print(f"weightcache {command}: error: {socket_dir} is not a directory", file=sys.stderr)
        return None, 2
    try:
        check_private_dir(socket_dir)  # a socket in a directory others can write may be anyone's
    except WeightCacheError as e:
        print(f"weightcache {command}: error: {e}", file=sys.stderr)
        return None, 2
    return socket_dir, 0


def status_main(args) -> int:
    from .errors import WeightCacheError
    from .status_table import collect, format_table

    socket_dir, code = _daemons_dir(args, "status")
    if socket_dir is None:
        return code
    rows = collect(socket_dir, timeout=args.timeout)
    try:
        held = _held_line(socket_dir, args.timeout)
    except WeightCacheError as e:  # the daemons are listed; what the custodian holds is unknown
        held = None
        problem = str(e)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, socket_dir))
        if held:
            print(held)
    if held is None:
        print(f"weightcache status: error: {problem}", file=sys.stderr)
        return 1
    return 0


def _held_line(socket_dir: Path, timeout: float) -> str:
    """One line on what the custodian holds ("" without one); raises when it does not answer."""
    from .custodian.client import CustodianClient
    from .errors import DaemonUnavailable
    from .progress import human_bytes
    from .sockets import custodian_socket_path

    if not custodian_socket_path(socket_dir).exists():
        return ""
    try:
        client = CustodianClient.connect(socket_dir, timeout=timeout)
    except DaemonUnavailable:
        return ""  # a socket left behind by a custodian that is gone
    try:
        held = client.holdings(timeout=timeout).holdings
    finally:
        client.close()
    orphans = [h for h in held if not h.served_by]
    leased = [h.expires_in for h in held if h.expires_in is not None]
    return (f"custodian pid {client.pid} holds {len(held)} cache(s), {human_bytes(sum(h.nbytes for h in held))}"
            + (f"; {len(orphans)} served by no daemon (`weightcache release` frees them)" if orphans else "")
            + (f"; {len(leased)} of a preload that is gone, the next freed in {min(leased):.0f} s" if leased else ""))


# ------------------------------------------------------------------------------------------------ verify

def verify_main(args) -> int:
    from .client import request_verify
    from .errors import DaemonUnavailable, WeightCacheError
    from .progress import human_bytes
    from .sockets import daemon_sockets

    if not args.timeout > 0:
        print(f"weightcache verify: error: --timeout must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    socket_dir, code = _daemons_dir(args, "verify")
    if socket_dir is None:
        return code
    rows = []
    for path in daemon_sockets(socket_dir):
        row = {"socket": str(path), "result": "", "message": "", "report": None}
        try:
            rep = request_verify(path, timeout=args.timeout)
        except DaemonUnavailable as e:
            stale = "stale" in str(e) or "gone" in str(e)
            row.update(result="stale" if stale else "unreachable", message=str(e))
        except (WeightCacheError, OSError) as e:
            row.update(result="error", message=str(e))
        else:
            import msgspec

            result = "ok" if rep.ok else "mismatch" if rep.checked else "not verified"
            row.update(result=result, report=msgspec.to_builtins(rep),
                       message=rep.message or (f"{human_bytes(rep.nbytes)} in {rep.seconds * 1e3:.1f} ms "
                                               f"({rep.algorithm}, {rep.chunk_bytes >> 10} KiB chunks)"))
        rows.append(row)
    bad = sum(r["result"] == "mismatch" for r in rows)
    unverified = sum(r["result"] not in ("ok", "mismatch", "stale") for r in rows)
    if args.json:
        print(json.dumps({"socket_dir": str(socket_dir), "daemons": rows, "mismatch": bad, "unverified": unverified},
                         indent=2))
    else:
        for r in rows:
            print(f"{r['result'].upper():<12} {Path(r['socket']).name}: {r['message']}")
        print(f"{len(rows)} daemon socket(s) in {socket_dir}: {sum(r['result'] == 'ok' for r in rows)} ok, {bad} "
              f"with changed weights, {unverified} not verified")
    return 1 if bad else 3 if unverified else 0


# ----------------------------------------------------------------------------------------------- release

def _release_dir(explicit: str | None) -> Path | None:
    """The socket directory to release from; None when an explicit one does not exist (nothing is held
    there). Raises WeightCacheError for one that is not ours alone (anyone could have put a socket there)."""
    from .sockets import check_private_dir, default_socket_dir

    if not explicit:
        return default_socket_dir()
    path = Path(explicit)
    if not os.path.lexists(path):
        return None
    return check_private_dir(path)


def release_main(args) -> int:
    from .custodian.client import CustodianClient
    from .errors import DaemonUnavailable, WeightCacheError
    from .progress import human_bytes
    from .sockets import custodian_socket_path

    try:
        socket_dir = _release_dir(args.socket_dir)
    except (OSError, WeightCacheError) as e:
        print(f"weightcache release: error: {e}", file=sys.stderr)
        return 2
    if args.stop and (args.names or args.model or args.list):
        print("weightcache release: error: --stop releases everything; drop NAME/--model/--list", file=sys.stderr)
        return 2
    try:
        if socket_dir is None:
            raise DaemonUnavailable("")
        client = CustodianClient.connect(custodian_socket_path(socket_dir), client="weightcache release",
                                         timeout=args.timeout)
    except DaemonUnavailable:
        if args.json:
            print(json.dumps({"custodian": None, "holdings": [], "released": []}))
        else:
            print(f"no custodian in {socket_dir or args.socket_dir}: nothing is held")
        return 0
    except WeightCacheError as e:  # it does not answer, or refuses us: what it holds is unknown
        print(f"weightcache release: error: {e}", file=sys.stderr)
        return 1
    try:
        held = client.holdings(timeout=args.timeout).holdings
        if args.list:
            if args.json:
                import msgspec

                print(json.dumps({"custodian": client.pid, "holdings": msgspec.to_builtins(held)}, indent=2))
            else:
                print(_holdings_table(held, client.pid, socket_dir))
            return 0
        if args.stop:
            gone = client.stop()
        else:
            unknown = [n for n in args.names if n not in {h.name for h in held}]
            if unknown:
                print(f"weightcache release: error: the custodian holds no cache named {', '.join(unknown)} "
                      "(see `weightcache release --list`)", file=sys.stderr)
                return 2
            names = [h.name for h in held if (not args.names or h.name in args.names)
                     and (args.model is None or h.model in (args.model, str(Path(args.model).resolve())))]
            gone = client.release(names) if names else None
    except WeightCacheError as e:
        print(f"weightcache release: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    released = gone.names if gone else []
    if args.json:
        print(json.dumps({"custodian": client.pid, "released": released, "nbytes": gone.nbytes if gone else 0}))
    elif released:
        print(f"released {len(released)} cache(s), {human_bytes(gone.nbytes)}: {', '.join(released)}")
    else:
        print("nothing to release")
    return 0


def _lease_text(h) -> str:
    if h.kept:
        return "kept"
    if h.expires_in is not None:
        return f"{h.expires_in:.0f}s"
    return f"pid {h.preload}" if h.preload else "-"


def _holdings_table(held, pid: int, socket_dir: Path) -> str:
    import time

    from .progress import human_bytes

    lines = [f"{'NAME':<40} {'MODEL':<30} {'BYTES':>10} {'SERVED BY':>10} {'HANDOVERS':>9} {'HELD':>8} "
             f"{'FREED IN':>10}"]
    now = time.time()
    for h in sorted(held, key=lambda h: h.name):
        age = now - h.deposited_at
        lines.append(f"{h.name:<40} {h.model[-30:]:<30} {human_bytes(h.nbytes):>10} "
                     f"{(str(h.served_by) if h.served_by else '-'):>10} {h.handovers:>9} {age:>7.0f}s "
                     f"{_lease_text(h):>10}")
    lines.append(f"\n{len(held)} cache(s) held by custodian pid {pid} in {socket_dir}; FREED IN: seconds left of "
                 "the lease of a cache whose preload is gone, 'pid N' while preload N runs, 'kept' until released")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- main

def _engine_of(argv: list[str]) -> str | None:
    from .argv import option_value

    return option_value(argv, "--engine")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "custodian":  # started by preload; not listed in --help
        from .custodian import server as custodian

        return custodian.main(argv[1:]) or 0
    if argv and argv[0] == "run":
        from .warm import client as warm_client

        return warm_client.main(argv[1:])
    if argv and argv[0] == "warm-engine":
        from .warm import main as warm_main

        return warm_main.main(argv[1:])
    if argv and argv[0] == "demo":
        from . import demo

        return demo.main(argv[1:]) or 0
    if argv and argv[0] == "preload":
        rest = argv[1:]
        from .preload import record
        from .preload.restart import restart

        record.note_start()  # before any engine adds its own environment variables

        code = restart(rest)  # the same preload again, its caches held: back without the engine
        if code is not None:
            return code
        if _engine_of(rest) == "vllm":
            from .preload import vllm_frontend as vllm_preload

            return vllm_preload.main(rest) or 0
        return preload_main(rest)
    args = build_parser().parse_args(argv)
    if args.command == "status":
        return status_main(args)
    if args.command == "release":
        return release_main(args)
    if args.command == "verify":
        return verify_main(args)
    return build_parser().parse_args(argv + ["--help"]) or 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
