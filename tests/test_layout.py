import itertools

import pytest

from weightcache.errors import LayoutError
from weightcache.preload.layout import Layout, is_loopback


def formula(dp_rank, pp_rank, tp_rank, pp, tp):
    return dp_rank * pp * tp + pp_rank * tp + tp_rank


SPREAD = [  # (dp, pp, tp, nnodes)
    (1, 1, 1, 1),
    (1, 1, 8, 1),
    (1, 2, 4, 1),
    (2, 2, 2, 1),
    (4, 1, 2, 1),
    (1, 1, 16, 2),
    (1, 2, 8, 2),
    (1, 4, 8, 4),
    (2, 1, 8, 4),
    (4, 2, 2, 2),
    (3, 1, 2, 3),
    (8, 1, 1, 8),
    (2, 2, 4, 8),
]


@pytest.mark.parametrize("dp,pp,tp,nnodes", SPREAD)
def test_spread_over_nodes_matches_formula(dp, pp, tp, nnodes):
    world = dp * pp * tp
    per_node = world // nnodes
    seen = []
    for node in range(nnodes):
        lay = Layout(tp=tp, pp=pp, dp=dp, nnodes=nnodes, node_rank=node,
                     master_addr="10.0.0.1" if nnodes > 1 else None)
        local = lay.local_placements()
        assert len(local) == per_node == lay.local_size
        for i, p in enumerate(local):
            assert p.rank == formula(p.dp_rank, p.pp_rank, p.tp_rank, pp, tp)
            assert p.rank == node * per_node + i  # consecutive ranks per node
            assert p.local_index == i and p.device == f"cuda:{i}"
            assert p.node_rank == node and p.world_size == world
            assert lay.placement(p.rank) == p
            assert lay.coords(p.rank) == (p.dp_rank, p.pp_rank, p.tp_rank)
        seen += [p.rank for p in local]
    assert sorted(seen) == list(range(world))


DP_LOCAL = [  # (dp, pp, tp, dp_local)
    (2, 1, 1, 1),
    (4, 1, 2, 2),
    (4, 2, 2, 1),
    (8, 1, 1, 4),
    (6, 1, 2, 2),
    (5, 1, 1, 2),  # uneven: the last node hosts one DP rank
    (2, 1, 4, 2),  # single node
]


@pytest.mark.parametrize("dp,pp,tp,dp_local", DP_LOCAL)
def test_dp_local_nodes_match_formula(dp, pp, tp, dp_local):
    seen = []
    nodes = -(-dp // dp_local)
    for node in range(nodes):
        start = node * dp_local
        local_dp = min(dp_local, dp - start)
        lay = Layout(tp=tp, pp=pp, dp=dp, dp_local=local_dp, dp_rank_start=start, dp_address="10.0.0.1",
                     nnodes=nodes, node_rank=node)
        assert lay.nodes == nodes and lay.this_node == node
        if dp % dp_local == 0:  # without --nnodes the node count follows from dp / dp_local
            bare = Layout(tp=tp, pp=pp, dp=dp, dp_local=local_dp, dp_rank_start=start, dp_address="10.0.0.1")
            assert (bare.nodes, bare.this_node) == (nodes, node)
            assert bare.local_placements() == lay.local_placements()
        local = lay.local_placements()
        assert len(local) == local_dp * pp * tp
        for i, p in enumerate(local):
            assert start <= p.dp_rank < start + local_dp
            assert p.rank == formula(p.dp_rank, p.pp_rank, p.tp_rank, pp, tp)
            assert p.local_index == (p.dp_rank - start) * pp * tp + p.pp_rank * tp + p.tp_rank == i
        seen += [p.rank for p in local]
    assert sorted(seen) == list(range(dp * pp * tp))


def test_dp_start_derived_from_node_rank():
    lay = Layout(tp=2, dp=4, dp_local=2, nnodes=2, node_rank=1, dp_address="10.0.0.1")
    assert lay.dp_start == 2
    assert [p.rank for p in lay.local_placements()] == [4, 5, 6, 7]
    assert [p.dp_rank for p in lay.local_placements()] == [2, 2, 3, 3]


def test_placement_table():
    # dp2-pp2-tp2 on one node: rank, (dp, pp, tp)
    lay = Layout(tp=2, pp=2, dp=2)
    got = [(p.rank, p.dp_rank, p.pp_rank, p.tp_rank, p.device) for p in lay.local_placements()]
    want = [(r, d, p, t, f"cuda:{r}") for r, (d, p, t) in enumerate(itertools.product(range(2), range(2), range(2)))]
    assert got == want
    assert lay.describe() == "dp2-pp2-tp2"
    assert lay.rank_of(1, 0, 1) == 5


def test_expert_parallel():
    lay = Layout(tp=2, dp=2, ep=True)
    assert lay.describe() == "dp2-pp1-tp2-ep4"
    assert [(p.ep_rank, p.ep_size) for p in lay.local_placements()] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    p = Layout(tp=2).local_placements()[1]
    assert (p.ep, p.ep_rank, p.ep_size) == (False, 0, 1)


def test_draft_role_same_placements():
    lay = Layout(tp=2, pp=2)
    draft = lay.draft()
    assert [p.role for p in draft.local_placements()] == ["draft"] * 4
    strip = lambda ps: [(p.rank, p.device, p.dp_rank, p.pp_rank, p.tp_rank) for p in ps]  # noqa: E731
    assert strip(draft.local_placements()) == strip(lay.local_placements())
    assert draft.describe() == lay.describe()


def test_cpu_devices():
    assert {p.device for p in Layout(tp=4, device_type="cpu").local_placements()} == {"cpu"}


def test_local_devices_enough():
    assert len(Layout(tp=4, local_devices=4).local_placements()) == 4
    assert len(Layout(tp=8, nnodes=2, node_rank=0, master_addr="n0", local_devices=4).local_placements()) == 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=0), "--tensor-parallel-size"),
        (dict(pp=-1), "--pipeline-parallel-size"),
        (dict(dp=0), "--data-parallel-size"),
        (dict(tp=1.5), "positive integer"),
        (dict(tp=True), "positive integer"),
        (dict(tp=3, nnodes=2, master_addr="n0"), "do not divide evenly over 2 nodes"),
        (dict(tp=2, nnodes=2, node_rank=2, master_addr="n0"), "--node-rank between 0 and 1"),
        (dict(tp=2, nnodes=2), "--master-addr"),
        (dict(tp=2, nnodes=2, master_addr="127.0.0.1"), "loopback"),
        (dict(tp=2, nnodes=2, master_addr="localhost"), "loopback"),
        (dict(tp=2, nnodes=2, master_addr="n0", dp_address="::1"), "--data-parallel-address"),
        (dict(dp=2, dp_local=1, dp_address="127.0.0.2"), "loopback"),
        (dict(dp=2, dp_local=1), "--data-parallel-address"),
        (dict(dp=2, dp_local=3), "exceeds the data parallel size"),
        (dict(dp=2, dp_local=0), "nothing to preload"),
        (dict(dp=4, dp_local=2, dp_rank_start=3, dp_address="n0"), "--data-parallel-start-rank"),
        (dict(dp=4, dp_local=2, nnodes=3, dp_address="n0"), "set it to 2"),
        (dict(dp=4, dp_local=2, nnodes=2, node_rank=1, dp_rank_start=3, dp_address="n0"), "start-rank"),
        (dict(dp=2, dp_local=1, nnodes=3, dp_address="n0"), "exceeds the data parallel size"),
        (dict(dp=2, dp_rank_start=1), "--data-parallel-size-local"),
        (dict(tp=8, local_devices=4), "only 4 device(s)"),
        (dict(tp=2, dp=4, dp_local=4, local_devices=7), "only 7 device(s)"),
        (dict(role="verifier"), "role must be one of"),
    ],
)
def test_refusals(kwargs, words):
    with pytest.raises(LayoutError) as ei:
        Layout(**kwargs)
    assert words in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_out_of_range_coordinates():
    lay = Layout(tp=2, pp=2)
    with pytest.raises(LayoutError, match="tp rank 2"):
        lay.rank_of(0, 0, 2)
    with pytest.raises(LayoutError, match="rank 4 is out of range"):
        lay.coords(4)


def test_from_vllm_args():
    lay = Layout.from_vllm_args(
        tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=4, data_parallel_size_local=2,
        data_parallel_start_rank=2, data_parallel_address="10.1.1.1", enable_expert_parallel=True,
        nnodes=None,
    )
    assert (lay.tp, lay.dp, lay.dp_local, lay.dp_start, lay.ep) == (2, 4, 2, 2, True)
    assert [p.rank for p in lay.local_placements()] == [4, 5, 6, 7]
    # --data-parallel-rank alone: one DP rank per launch (external load balancing)
    one = Layout.from_vllm_args(tensor_parallel_size=2, data_parallel_size=4, data_parallel_rank=3,
                                data_parallel_address="10.1.1.1")
    assert [p.rank for p in one.local_placements()] == [6, 7]
    assert [p.device for p in one.local_placements()] == ["cuda:0", "cuda:1"]
    with pytest.raises(LayoutError, match="unknown layout argument"):
        Layout.from_vllm_args(tensor_parallel=2)


@pytest.mark.parametrize("addr, loop", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("10.0.0.1", False), ("node0", False), ("fe80::1", False), ("0.0.0.0", False),
])
def test_is_loopback(addr, loop):
    assert is_loopback(addr) is loop
