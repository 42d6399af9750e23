"""What a preload says at the end of its start: the one READY line once every local rank serves (what is held
where, how it got there), or which daemons failed and why."""

from __future__ import annotations

import signal

from ..progress import human_bytes
from .child import exit_code_of


def ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def how_ready(children) -> str:
    """How the daemons got their weights: a load's time and rate; a cache taken over from the custodian (no load)
    by the time it took, never as a rate."""
    def seconds(c) -> float:
        return float(c.ready_info.get("load_seconds", 0))

    loaded = [c for c in children if not c.ready_info.get("adopted")]
    adopted = [c for c in children if c.ready_info.get("adopted")]
    out = []
    load_s = max(map(seconds, loaded), default=0.0)
    if load_s > 0:
        nbytes = sum(int(c.ready_info.get("nbytes", 0)) for c in loaded)
        out.append(f" loaded in {load_s:.1f} s ({nbytes / load_s / 1e9:.2f} GB/s)")
    if adopted:
        some = f"{len(adopted)} of {len(children)} " if loaded else ""
        out.append(f"{',' if out else ''} {some}taken over from the custodian in "
                   f"{max(map(seconds, adopted)) * 1e3:.1f} ms (no load)")
    return "".join(out)


def ready_line(groups, children, *, node_rank: int, nnodes: int, socket_dir, health_url: str | None) -> str:
    parts = []
    for g in groups:
        local = g.layout.local_placements()
        devices = sorted({p.device for p in local})
        parts.append(f"{g.role}: rank {ranks_text([p.rank for p in local])} of {g.layout.world_size} "
                     f"({g.layout.describe()}) on {','.join(devices)}")
    nbytes = sum(int(c.ready_info.get("nbytes", 0)) for c in children)
    per_role = {len(g.layout.local_placements()) for g in groups}
    ranks = per_role.pop() if len(per_role) == 1 else "/".join(str(len(g.layout.local_placements())) for g in groups)
    line = (f"weightcache READY node {node_rank}/{nnodes}: {ranks} rank(s) x {len(groups)} role(s) "
            f"[{'; '.join(parts)}], {human_bytes(nbytes)}{how_ready(children)}, sockets in {socket_dir}")
    return line + (f", health {health_url}" if health_url else "")


def failure_report(children, *, node_rank: int, nnodes: int) -> tuple[str, int]:
    """The start-up failure of the daemons that exited (reported together: one bad file fails every rank), and the
    exit code to use (the worst)."""
    dead = [c for c in children if c.exited]
    lines, worst = [], 0
    for c in dead:
        c.reported = True
        worst = max(worst, exit_code_of(c.proc.exitcode))
        why = c.message or (f"killed by {signal.Signals(-c.proc.exitcode).name}" if c.proc.exitcode < 0
                            else "exited without saying why")
        lines.append(f"{c.label} exited with code {c.proc.exitcode}: {why}")
    ranks = sorted(c.spec.placement.rank for c in dead)
    others = [f"{c.spec.role} rank {c.spec.placement.rank} ({c.state})" for c in children if not c.exited]
    if others:
        lines.append("stopping the others: " + ", ".join(others))
    return (f"node {node_rank}/{nnodes}: {len(dead)} of {len(children)} daemon(s) failed during start-up "
            f"(rank {ranks_text(ranks)}):\n  " + "\n  ".join(lines), worst)
