"""Rendezvous over a real TCPStore on loopback; each "node" runs in its own thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from weightcache.preload.rendezvous import Rendezvous, RendezvousError, stamp_diff

STAMP = {"model": "tiny", "content_digest": "sha256:aa", "dtype": "float32", "layout": "dp1-pp1-tp2"}


def run_nodes(nnodes, body, port=0, timeout=20.0):
    """Start node 0 (to learn the port), then the others; body(rdv) runs in a thread per node."""
    results: dict[int, object] = {}
    master = Rendezvous(group="main", master_addr="127.0.0.1", master_port=port, nnodes=nnodes, node_rank=0,
                        timeout=timeout)
    port = master.start()

    def node(n):
        rdv = master if n == 0 else Rendezvous(group="main", master_addr="127.0.0.1", master_port=port,
                                               nnodes=nnodes, node_rank=n, timeout=timeout)
        try:
            if n:
                rdv.start()
            results[n] = body(n, rdv)
        except Exception as e:
            results[n] = e
        finally:
            rdv.close()

    threads = [threading.Thread(target=node, args=(n,)) for n in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_nodes_agree_and_become_ready():
    def body(n, rdv):
        stamps = rdv.agree(STAMP, ranks=[2 * n, 2 * n + 1], world_size=4)
        assert stamps[0] == stamps[1] == STAMP
        rdv.mark_ready({"node": n})
        return rdv.wait_ready()

    res = run_nodes(2, body)
    assert res[0] == res[1] == {0: {"node": 0}, 1: {"node": 1}}


def test_different_checkpoint_fails_every_node_naming_the_fields():
    def body(n, rdv):
        stamp = dict(STAMP, content_digest="sha256:bb", dtype="bfloat16") if n == 1 else STAMP
        rdv.agree(stamp, ranks=[n])

    res = run_nodes(2, body)
    for n in (0, 1):
        err = res[n]
        assert isinstance(err, RendezvousError), err
        msg = str(err)
        assert "node 1's checkpoint stamp differs from node 0's" in msg
        assert "content_digest: node 0 has 'sha256:aa', node 1 has 'sha256:bb'" in msg
        assert "dtype: node 0 has 'float32', node 1 has 'bfloat16'" in msg
        assert "layout" not in msg.split("differs")[1].split(":")[0]


def test_failure_on_one_node_stops_the_others():
    def body(n, rdv):
        rdv.agree(STAMP, ranks=[n])
        if n == 1:
            rdv.fail("rank 1 (main) exited with code 1: out of memory")
            return "failed"
        rdv.mark_ready()
        return rdv.wait_ready()

    res = run_nodes(2, body)
    assert res[1] == "failed"
    assert isinstance(res[0], RendezvousError)
    assert "node 1: rank 1 (main) exited with code 1: out of memory" in str(res[0])


def test_overlapping_and_missing_ranks_are_refused():
    res = run_nodes(2, lambda n, rdv: rdv.agree(STAMP, ranks=[0, 1], world_size=3))
    for n in (0, 1):
        assert "rank 0 is claimed by node 0 and node 1" in str(res[n])
        assert "no node holds rank(s) [2]" in str(res[n])


def test_a_node_that_never_joins_times_out_clearly():
    rdv = Rendezvous(group="draft", master_addr="127.0.0.1", master_port=0, nnodes=2, node_rank=0, timeout=0.5)
    rdv.start()
    try:
        with pytest.raises(RendezvousError, match=r"\[draft\] timed out .* every node to join: missing stamp/1"):
            rdv.agree(STAMP, ranks=[0])
    finally:
        rdv.close()


def test_on_poll_errors_stop_the_wait_and_reach_the_other_node():
    class LocalDaemonDied(Exception):
        pass

    def body(n, rdv):
        if n == 0:
            def check():
                raise LocalDaemonDied("rank 0 exited with code 3")
            try:
                rdv.agree(STAMP, ranks=[0], on_poll=check)
            except LocalDaemonDied as e:
                rdv.fail(str(e))
                raise
        time.sleep(0.2)
        return rdv.agree(STAMP, ranks=[1])

    res = run_nodes(2, body)
    assert isinstance(res[0], Exception) and "rank 0 exited with code 3" in str(res[0])
    assert isinstance(res[1], RendezvousError) and "node 0: rank 0 exited with code 3" in str(res[1])


def test_duplicate_node_rank_is_refused():
    master = Rendezvous(group="main", master_addr="127.0.0.1", master_port=0, nnodes=3, node_rank=0, timeout=5)
    port = master.start()
    twins = [Rendezvous(group="main", master_addr="127.0.0.1", master_port=port, nnodes=3, node_rank=1, timeout=5)
             for _ in range(2)]
    errors: list[BaseException] = []

    def join(rdv, ranks):
        try:
            rdv.agree(STAMP, ranks=ranks)
        except RendezvousError as e:
            errors.append(e)

    try:
        for t in twins:
            t.start()
        threads = [threading.Thread(target=join, args=(t, [r])) for t, r in zip(twins, (1, 2), strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        msgs = sorted(str(e) for e in errors)
        assert len(msgs) == 2, msgs
        # The second to join is refused outright; the first learns it from the store.
        assert any("already joined as node 1" in m for m in msgs), msgs
        assert any("two supervisors started with --node-rank 1" in m for m in msgs), msgs
        with pytest.raises(RendezvousError, match="two supervisors started with --node-rank 1"):
            master.agree(STAMP, ranks=[0])
    finally:
        for r in (*twins, master):
            r.close()


def test_port_in_use_and_unreachable_master():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"rendezvous port {port} is already in use on this host"):
            Rendezvous(group="main", master_addr="127.0.0.1", master_port=port, nnodes=2, node_rank=0).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    rdv = Rendezvous(group="main", master_addr="127.0.0.1", master_port=free, nnodes=2, node_rank=1, timeout=0.5)
    with pytest.raises(RendezvousError, match=f"node 1 cannot reach the master at 127.0.0.1:{free}"):
        rdv.start()


def test_bad_arguments():
    with pytest.raises(RendezvousError, match="node rank 2 is outside 0..1"):
        Rendezvous(group="main", master_addr="127.0.0.1", master_port=1, nnodes=2, node_rank=2)
    with pytest.raises(RendezvousError, match="master port is required"):
        Rendezvous(group="main", master_addr="127.0.0.1", master_port=0, nnodes=2, node_rank=1)


def test_stamp_diff():
    assert stamp_diff({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "x"}) == [("b", "2", "3"), ("c", "", "x")]
