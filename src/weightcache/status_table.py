"""`weightcache status`: every daemon socket in a directory, asked for its status; stale ones marked."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from .progress import human_bytes, human_duration
from .sockets import daemon_sockets, parse_socket_name

COLUMNS = ("ROLE", "RANK", "DEVICE", "MODEL", "BYTES", "TENSORS", "CLIENTS", "UPTIME", "STATE")


def _from_name(path: Path) -> dict:
    parsed = parse_socket_name(path.name)
    if parsed is None:
        return {"role": "?", "rank": None, "device": ""}
    return {"role": parsed["role"], "rank": parsed["rank"], "device": parsed["device"]}


def collect(socket_dir: str | Path, timeout: float = 2.0) -> list[dict]:
    """One row per *.sock in `socket_dir` (live, stale, unresponsive or refused), sorted by role and rank."""
    from .client import query_status
    from .errors import DaemonBusy, DaemonUnavailable, PermissionDenied, WeightCacheError

    rows = []
    now = time.time()
    for path in daemon_sockets(socket_dir):
        row = {"socket": str(path), **_from_name(path), "model": "", "nbytes": None, "ntensors": None,
               "clients": None, "uptime_s": None, "state": "", "message": "", "pid": None, "status": None}
        try:
            st = query_status(path, timeout=timeout)
        except DaemonBusy as e:
            row["state"], row["message"] = "busy", str(e)
        except DaemonUnavailable as e:
            msg = str(e)
            row["state"] = "stale" if "stale" in msg or "gone" in msg else "unreachable"
            row["message"] = msg
        except PermissionDenied as e:
            row["state"], row["message"] = "denied", str(e)
        except (WeightCacheError, OSError) as e:
            row["state"], row["message"] = "error", str(e)
        else:
            row.update(role=st.key.role, rank=st.key.rank, device=st.device, model=st.key.model,
                       nbytes=st.nbytes, ntensors=st.ntensors, clients=st.clients_attached,
                       uptime_s=round(now - st.started_at, 3), state=st.state, message=st.message, pid=st.pid,
                       status=msgspec.to_builtins(st))
            if st.state == "loading" and st.total:
                row["state"] = f"loading {100.0 * st.done / st.total:.0f}%"
                if st.load_bytes_per_second:
                    row["state"] += f" {st.load_bytes_per_second / 1e9:.2f} GB/s"
        rows.append(row)
    rows.sort(key=lambda r: (r["role"] != "main", r["role"], r["rank"] if r["rank"] is not None else -1,
                             r["socket"]))
    return rows


def _short_model(model: str, width: int = 40) -> str:
    if len(model) <= width:
        return model
    return "..." + model[-(width - 3):]


def format_table(rows: list[dict], socket_dir: str | Path = "") -> str:
    if not rows:
        return f"no weight cache daemons in {socket_dir}"
    cells = [COLUMNS]
    for r in rows:
        cells.append((
            r["role"], "-" if r["rank"] is None else str(r["rank"]), r["device"] or "-",
            _short_model(r["model"]) or "-", human_bytes(r["nbytes"]),
            "-" if r["ntensors"] is None else str(r["ntensors"]),
            "-" if r["clients"] is None else str(r["clients"]), human_duration(r["uptime_s"]), r["state"],
        ))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    stale = sum(r["state"] == "stale" for r in rows)
    foot = f"{len(rows)} daemon socket(s) in {socket_dir}"
    if stale:
        foot += f"; {stale} stale (its daemon is gone; the next daemon on that socket replaces it)"
    return "\n".join(lines + ["", foot])
