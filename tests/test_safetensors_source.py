import functools
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcache.dtypes import parse_dtype
from weightcache.sources import Source
from weightcache.sources.safetensors import CheckpointError, SafetensorsSource
from weightcache.sources.tp_plan import ShardSpec, TPPlan, TPPlanError, spec_for_style
from weightcache.testing.checkpoints import make_llama_checkpoint

pytest.importorskip("transformers")


def views_for(src, device="cpu"):
    return {m.name: torch.empty(m.shape, dtype=parse_dtype(m.dtype), device=device) for m in src.describe()}


def fill(src, device="cpu"):
    views = views_for(src, device)
    got = []
    src.fill(views, got.append)
    assert sum(got) == src.nbytes
    return views


def load_dir(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def expected_shard(t, dim, split, rank, tp):
    if dim is None:
        return t
    parts = t.chunk(split, dim)
    return torch.cat([p.chunk(tp, dim)[rank] for p in parts], dim)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama"), num_kv_heads=4)


@pytest.fixture(scope="module")
def llama_sharded(tmp_path_factory):
    return make_llama_checkpoint(
        tmp_path_factory.mktemp("llama_sharded"), num_kv_heads=4, max_shard_bytes=30_000, tie_word_embeddings=True
    )


LLAMA_DIMS = {  # transformers' Llama plan: q/k/v/gate/up colwise (dim 0), o/down rowwise (dim 1)
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "lm_head.weight": 0,  # colwise_gather_output
}


@functools.cache
def transformers_shards_embedding(model_dir) -> bool:
    """Whether this transformers' plan for the checkpoint makes the input embedding vocab-parallel: releases
    up to 5.19 did so for tied embeddings only, later ones (``model.embed_tokens: embedding_rowwise``) always."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return dict(model.tp_plan).get("model.embed_tokens") == "embedding_rowwise"


def llama_dim(name, tied=False):
    if tied and name == "model.embed_tokens.weight":
        return 0  # vocab-parallel input embedding (embedding_rowwise)
    for suffix, d in LLAMA_DIMS.items():
        if name.endswith(suffix):
            return d
    return None


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("which", ["llama", "llama_sharded"])
def test_tp_shards_concatenate_to_original(request, which, tp):
    path = request.getfixturevalue(which)
    full = load_dir(path)
    ranks = []
    for r in range(tp):
        src = SafetensorsSource(path, tp_rank=r, tp_size=tp, progress=False)
        assert isinstance(src, Source)
        assert set(src.tensors) == set(full)
        ranks.append(fill(src))
    for name, t in full.items():
        d = llama_dim(name, tied=transformers_shards_embedding(path)) if tp > 1 else None
        if d is None:
            for v in ranks:
                assert torch.equal(v[name], t), name
        else:
            assert all(v[name].shape[d] == t.shape[d] // tp for v in ranks)
            assert torch.equal(torch.cat([v[name] for v in ranks], d), t), name


def test_describe_reads_no_data_and_matches_plan(llama):
    src = SafetensorsSource(llama, tp_rank=1, tp_size=2, progress=False)
    metas = {m.name: m for m in src.describe()}
    assert metas["model.layers.0.self_attn.q_proj.weight"].shape == [64, 64]  # 4 heads x 32, half
    assert metas["model.layers.0.self_attn.o_proj.weight"].shape == [64, 64]
    assert metas["model.layers.0.self_attn.k_proj.weight"].shape == [64, 64]  # 4 kv heads x 32, half
    assert metas["model.embed_tokens.weight"].shape == [256 if transformers_shards_embedding(llama) else 512, 64]
    assert {m.dtype for m in metas.values()} == {"float32"}
    assert src.plan.source.startswith("transformers LlamaForCausalLM")


@pytest.mark.parametrize("io", ["auto", "mmap"])
@pytest.mark.parametrize("threads", [1, 3])
def test_small_chunks_and_io_modes(llama, io, threads):
    full = load_dir(llama)
    src = SafetensorsSource(llama, tp_rank=1, tp_size=2, chunk_bytes=4096, io=io, threads=threads, progress=False)
    v = fill(src)
    for name, t in full.items():
        d = llama_dim(name, tied=transformers_shards_embedding(llama))
        assert torch.equal(v[name], expected_shard(t, d, 1, 1, 2)), name


@pytest.mark.parametrize("tp", [1, 2])
def test_dtype_cast(llama, tp):
    full = load_dir(llama)
    src = SafetensorsSource(llama, dtype=torch.bfloat16, tp_rank=tp - 1, tp_size=tp, progress=False)
    assert {m.dtype for m in src.describe()} == {"bfloat16"}
    v = fill(src)
    for name, t in full.items():
        want = expected_shard(t, llama_dim(name, tied=transformers_shards_embedding(llama)) if tp > 1 else None, 1,
                              tp - 1, tp).to(torch.bfloat16)
        assert torch.equal(v[name], want), name
    assert src.key_fields()["dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    d = tmp_path_factory.mktemp("custom")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g),
        "model.layers.0.mlp.gate_up_proj.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.gate_up_proj.bias": torch.randn(16, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=g),
        "model.layers.0.mlp.down_proj.bias": torch.randn(8, generator=g),
        "model.layers.0.attn.qkv.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.attn.qkv.bias": torch.randn(12, generator=g),
        "model.layers.0.attn.fused_out.weight": torch.randn(8, 16, generator=g),
        "model.layers.0.experts.w1": torch.randn(4, 8, 6, generator=g),
        "model.layers.0.experts.w2": torch.randn(4, 8, 6, generator=g),
        "model.layers.0.norm.weight": torch.randn(8, generator=g),
        "model.layers.0.steps": torch.arange(12, dtype=torch.int64),
        "lm_head.weight": torch.randn(32, 8, generator=g).to(torch.float16),
        "scale": torch.tensor(0.5),
    }
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, tensors


CUSTOM_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise",  # base-model-relative key
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.attn.qkv": "colwise",
    "model.layers.*.attn.fused_out": "packed_rowwise",
    "model.layers.*.experts.w1": "grouped_gemm",
    "model.layers.*.experts.w2": "colwise",  # 3-D: dim 1, a strided read
    "model.layers.*.norm": "sequence_parallel",
    "lm_head": "colwise_rep",
}

CUSTOM_EXPECT = {  # name -> (dim, split); None = replicated
    "model.embed_tokens.weight": (0, 1),
    "model.layers.0.mlp.gate_up_proj.weight": (0, 2),
    "model.layers.0.mlp.gate_up_proj.bias": (0, 1),
    "model.layers.0.mlp.down_proj.weight": (1, 1),
    "model.layers.0.mlp.down_proj.bias": None,
    "model.layers.0.attn.qkv.weight": (0, 1),
    "model.layers.0.attn.qkv.bias": (0, 1),
    "model.layers.0.attn.fused_out.weight": (1, 2),
    "model.layers.0.experts.w1": (0, 1),
    "model.layers.0.experts.w2": (1, 1),
    "model.layers.0.norm.weight": None,
    "model.layers.0.steps": None,
    "lm_head.weight": (0, 1),
    "scale": None,
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_user_plan_styles(custom, tp, dtype):
    path, tensors = custom
    for r in range(tp):
        src = SafetensorsSource(path, tp_rank=r, tp_size=tp, tp_plan=CUSTOM_PLAN, dtype=dtype, chunk_bytes=4096,
                                progress=False)
        v = fill(src)
        for name, t in tensors.items():
            dim, split = CUSTOM_EXPECT[name] or (None, 1)
            want = expected_shard(t, dim, split, r, tp)
            if dtype is not None and t.is_floating_point():
                want = want.to(dtype)
            assert v[name].dtype == want.dtype and torch.equal(v[name], want), (name, r)


def test_custom_plan_in_key_fields(custom):
    path, _ = custom
    plain = SafetensorsSource(path, progress=False).key_fields()
    assert "tp_plan" not in plain
    assert plain["dtype"] == "float16+float32"
    planned = SafetensorsSource(path, tp_size=2, tp_plan=CUSTOM_PLAN, progress=False).key_fields()
    assert planned["tp_plan"].startswith("sha256:")
    assert planned["content_digest"] == plain["content_digest"]
    replicated = SafetensorsSource(path, tp_size=2, tp_plan="none", progress=False).key_fields()
    assert replicated["tp_plan"] != planned["tp_plan"]
    assert "tp_plan" not in SafetensorsSource(path, tp_plan=CUSTOM_PLAN, progress=False).key_fields()  # tp 1


def test_embedding_colwise_shards_hidden_dim(custom):
    path, tensors = custom
    src = SafetensorsSource(path, tp_rank=1, tp_size=2, tp_plan={"model.embed_tokens": "colwise"}, progress=False)
    v = fill(src)
    assert torch.equal(v["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"][:, 4:])


def test_spec_rules_follow_transformers():
    assert spec_for_style("colwise", "a.weight", 2) == ShardSpec("colwise", 0)
    assert spec_for_style("colwise", "a.bias", 1) == ShardSpec("colwise", 0)
    assert spec_for_style("colwise", "e.weight", 2, embedding=True) == ShardSpec("colwise", 1)
    assert spec_for_style("rowwise", "a.weight", 2) == ShardSpec("rowwise", 1)
    assert spec_for_style("rowwise", "a.bias", 1) == ShardSpec("rowwise", None)
    assert spec_for_style("rowwise", "e.weight", 2, embedding=True) == ShardSpec("rowwise", 0)
    assert spec_for_style("packed_colwise", "a.weight", 3) == ShardSpec("packed_colwise", 1, 2)
    assert spec_for_style("packed_rowwise", "a.bias", 1) == ShardSpec("packed_rowwise", None)
    assert spec_for_style(None, "a.weight", 2).replicated
    with pytest.raises(TPPlanError, match="unknown tensor parallel style"):
        spec_for_style("diagonal", "a.weight", 2)
    # transformers' own matching: layer numbers -> "*", parameter falls back to its module
    plan = TPPlan({"model.layers.*.q": "colwise", "model.layers.*.q.weight": "rowwise"})
    assert plan.style("model.layers.11.q.weight") == "rowwise"
    assert plan.style("model.layers.11.q.bias") == "colwise"
    assert plan.style("model.layers.1.w2.weight") is None


def test_transformers_plan_for_llama(llama):
    plan = TPPlan.from_pretrained(llama)
    assert plan.style("model.layers.3.self_attn.q_proj.weight") == "colwise"
    assert plan.style("model.layers.3.mlp.down_proj.weight") == "rowwise"
    assert plan.style("lm_head.weight") == "colwise_gather_output"
    assert plan.style("model.norm.weight") is None
    assert plan.embeddings == {"model.embed_tokens"}
    want = "embedding_rowwise" if transformers_shards_embedding(llama) else None
    assert plan.style("model.embed_tokens.weight") == want


def test_transformers_plan_tied_embedding_is_vocab_parallel(llama_sharded):
    plan = TPPlan.from_pretrained(llama_sharded)
    assert plan.style("model.embed_tokens.weight") == "embedding_rowwise"
    assert plan.spec("model.embed_tokens.weight", (512, 64)) == ShardSpec("embedding_rowwise", 0)


def test_plan_from_config_json_without_transformers_class(tmp_path):
    save_file({"model.layers.0.q.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "not-a-real-model", "base_model_tp_plan": {"layers.*.q": "colwise"}}))
    src = SafetensorsSource(tmp_path, tp_size=2, tp_rank=1, progress=False)
    assert src.describe()[0].shape == [2, 2]


# -- errors -------------------------------------------------------------------------------------------


def test_indivisible_dim_is_refused(llama):
    with pytest.raises(TPPlanError, match=r"model.safetensors: .*weight: dim 0 \(size \d+\) of shape .* does not divide into 3 ranks"):
        SafetensorsSource(llama, tp_rank=0, tp_size=3, progress=False)


def test_packed_indivisible_is_refused(custom):
    path, _ = custom
    with pytest.raises(TPPlanError, match="gate_up_proj.weight: dim 0 .*2 packed parts x 16 ranks"):
        SafetensorsSource(path, tp_size=16, tp_plan={"model.layers.*.mlp.gate_up_proj": "packed_colwise"},
                          progress=False)


@pytest.mark.parametrize(
    "kwargs, err, words",
    [
        (dict(tp_size=0), ValueError, "tp_size"),
        (dict(tp_size=2, tp_rank=2), ValueError, "tp_rank"),
        (dict(dtype="bf16"), TypeError, "dtype"),
        (dict(io="bogus"), ValueError, "io must be one of"),
        (dict(chunk_bytes=5000), ValueError, "chunk_bytes must be a positive multiple of 4096"),
        (dict(depth=0), ValueError, "depth must be"),
        (dict(streams=3, depth=2), ValueError, r"streams must be in \[1, depth=2\]"),
        (dict(order="random"), ValueError, "order must be"),
        (dict(threads=0), ValueError, "threads"),
        (dict(tp_size=2, tp_plan={"model.x": "diagonal"}), TPPlanError, "unknown style"),
        (dict(tp_size=2, tp_plan=42), TPPlanError, "tp_plan must be"),
    ],
)
def test_bad_arguments(llama, kwargs, err, words):
    with pytest.raises(err, match=words):
        SafetensorsSource(llama, progress=False, **kwargs)


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_shard_named(llama_sharded, tmp_path):
    d = copy_dir(llama_sharded, tmp_path / "c")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}, which is missing"):
        SafetensorsSource(d, progress=False)


def test_index_names_tensor_the_shard_lacks(llama_sharded, tmp_path):
    d = copy_dir(llama_sharded, tmp_path / "c")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.ghost.weight"] = first
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"'model.layers.0.ghost.weight' to {first}, but that file lacks it"):
        SafetensorsSource(d, progress=False)


def test_truncated_and_corrupt_files(llama, tmp_path):
    d = copy_dir(llama, tmp_path / "t")
    f = d / "model.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 100)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* ends at byte .*truncated"):
        SafetensorsSource(d, progress=False)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        SafetensorsSource(d, progress=False)
    f.write_bytes(b"\xff" * 8)
    with pytest.raises(CheckpointError, match="not a safetensors file or truncated"):
        SafetensorsSource(d, progress=False)
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a safetensors file \(only 0 bytes\)"):
        SafetensorsSource(d, progress=False)


@pytest.mark.parametrize("io", ["auto", "mmap"])
def test_file_truncated_after_describe(llama, tmp_path, io):
    d = copy_dir(llama, tmp_path / "t")
    src = SafetensorsSource(d, io=io, progress=False)
    views = views_for(src)
    os.truncate(d / "model.safetensors", 4096)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        src.fill(views, lambda n: None)


def test_not_found_and_empty(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        SafetensorsSource(tmp_path / "nope", progress=False)
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        SafetensorsSource(tmp_path, progress=False)


def test_duplicate_tensor_without_index(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointError, match="'a' is in both x.safetensors and y.safetensors"):
        SafetensorsSource(tmp_path, progress=False)


def test_single_file_path(custom):
    path, tensors = custom
    src = SafetensorsSource(path / "model.safetensors", progress=False)
    v = fill(src)
    assert all(torch.equal(v[n], t) for n, t in tensors.items())


def test_bad_views(llama):
    src = SafetensorsSource(llama, progress=False)
    views = views_for(src)
    views.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match="no destination view for tensor 'model.norm.weight'"):
        src.fill(views, lambda n: None)
    views = views_for(src)
    views["model.norm.weight"] = torch.empty(3)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' is torch.float32 \[3\], expected torch.float32 \[64\]"):
        src.fill(views, lambda n: None)


def test_progress_log_lines_without_tty(llama, caplog):
    src = SafetensorsSource(llama, progress=True)
    with caplog.at_level(logging.INFO, logger="weightcache.sources.safetensors"):
        fill(src)
    assert any("GB/s" in r.getMessage() and "(100%)" in r.getMessage() for r in caplog.records)


def test_key_fields(llama):
    from weightcache.digests import checkpoint_digest
    from weightcache.key import CacheKey

    f = SafetensorsSource(llama, progress=False).key_fields()
    assert f == {"model": str(llama.resolve()), "content_digest": checkpoint_digest(llama), "dtype": "float32"}
    CacheKey(**f)  # fits the cache key
    assert SafetensorsSource(llama, name="org/tiny", progress=False).key_fields()["model"] == "org/tiny"


def test_daemon_loads_rank_and_engine_attaches(llama, sockdir):
    import weightcache as wc
    from weightcache.key import CacheKey

    full = load_dir(llama)
    src = SafetensorsSource(llama, tp_rank=1, tp_size=2, progress=False)
    key = CacheKey(**src.key_fields(), layout="dp1-pp1-tp2", rank=1)
    daemon = wc.Daemon(os.path.join(sockdir, "r1.sock"), key)
    daemon.start()
    try:
        daemon.load(src)
        assert daemon.status().done == daemon.status().total == src.nbytes
        with wc.attach(os.path.join(sockdir, "r1.sock"), expect=key) as att:
            assert set(att) == set(full)
            for name, t in full.items():
                assert torch.equal(att[name], expected_shard(
                    t, llama_dim(name, tied=transformers_shards_embedding(llama)), 1, 1, 2)), name
    finally:
        daemon.close()


CUDA_OPTIONS = [dict(io="auto"), dict(io="mmap"), dict(io="staged"), dict(io="direct"),
                dict(io="register", register_bytes=8192), dict(io="register", depth=3, streams=3, order="interleave"),
                dict(io="staged", hugepages=True, depth=3, streams=2),
                dict(io="staged", stage_read="native", window_bytes=16384, windows=2, tile_bytes=4096),
                dict(io="staged", stage_read="native", threads=3, window_bytes=8192, windows=3, tile_bytes=8192)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opts", CUDA_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cuda_fill_matches_cpu(llama_sharded, opts, dtype):
    src = SafetensorsSource(llama_sharded, tp_rank=1, tp_size=2, dtype=dtype, device="cuda", chunk_bytes=8192,
                            progress=False, **opts)
    gpu = fill(src, "cuda")
    cpu = fill(SafetensorsSource(llama_sharded, tp_rank=1, tp_size=2, dtype=dtype, progress=False))
    for name, t in cpu.items():
        assert gpu[name].device.type == "cuda"
        assert torch.equal(gpu[name].cpu(), t), name
    full = load_dir(llama_sharded)
    for name, t in full.items():
        want = expected_shard(t, llama_dim(name, tied=True), 1, 1, 2)
        assert torch.equal(gpu[name].cpu(), want if dtype is None else want.to(dtype)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_user_plan_strided(custom):
    path, tensors = custom
    src = SafetensorsSource(path, tp_rank=1, tp_size=2, tp_plan=CUSTOM_PLAN, device="cuda", chunk_bytes=4096,
                            progress=False)
    v = fill(src, "cuda")
    for name, t in tensors.items():
        dim, split = CUSTOM_EXPECT[name] or (None, 1)
        assert torch.equal(v[name].cpu(), expected_shard(t, dim, split, 1, 2)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_fill_with_instanttensor_reader(llama_sharded, tp):
    pytest.importorskip("instanttensor")
    src = SafetensorsSource(llama_sharded, tp_rank=tp - 1, tp_size=tp, device="cuda", io="instanttensor",
                            progress=False)
    gpu = fill(src, "cuda")
    cpu = fill(SafetensorsSource(llama_sharded, tp_rank=tp - 1, tp_size=tp, progress=False))
    for name, t in cpu.items():
        assert torch.equal(gpu[name].cpu(), t), name


def test_packed_shards_match_torch_strided_shard(custom):
    """packed_* styles are transformers' _StridedShard(split_factor=2); check against torch's own split."""
    strided = pytest.importorskip("torch.distributed.tensor.placement_types")._StridedShard
    path, tensors = custom
    plan = {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.attn.fused_out": "packed_rowwise"}
    for tp in (2, 4):
        for r in range(tp):
            v = fill(SafetensorsSource(path, tp_rank=r, tp_size=tp, tp_plan=plan, progress=False))
            for name, dim in (("model.layers.0.mlp.gate_up_proj.weight", 0), ("model.layers.0.attn.fused_out.weight", 1)):
                shards, _ = strided(dim, split_factor=2)._split_tensor(tensors[name], tp, with_padding=False)
                assert torch.equal(v[name], shards[r]), (name, r)


def test_load_bench_runs_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_load", Path(__file__).parents[1] / "bench" / "load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "load.json"
    assert bench.main(["--device", "cpu", "--size-gb", "0.004", "--shard-gb", "0.001", "--dir", str(tmp_path),
                       "--runs", "1", "--tp", "2", "--out", str(out), "--sweep", "io=staged,threads=1,chunk_mb=1",
                       "--methods", "weightcache,weightcache-mmap,safetensors,instanttensor,memcpy-fresh"]) == 0
    info = json.loads(out.read_text())
    res = {r["method"]: r for r in info["results"]}
    ntensors = len(SafetensorsSource(info["checkpoint"]["path"], progress=False).tensors)
    for m in ("weightcache", "weightcache-mmap", "wc[io=staged threads=1 chunk_mb=1]"):
        assert res[m]["verified"] == ntensors and res[m]["gb_per_s"] > 0 and res[m]["buffers"] == "arena"
    assert res["weightcache"]["bytes"] == res["weightcache-mmap"]["bytes"]
    assert "skipped" in res["safetensors"]  # whole tensors only; tp=2 asked
    assert res["instanttensor"]["skipped"] == "CUDA only"
    assert res["memcpy-fresh"]["gb_per_s"] > 0
    assert info["summary"]["fastest_weightcache"]["gb_per_s"] > 0
