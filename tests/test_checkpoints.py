import json

import pytest
import torch
from safetensors import safe_open

from weightcache.testing.checkpoints import (
    estimate_llama_bytes,
    llama_config_for_bytes,
    llama_param_shapes,
    make_llama_checkpoint,
)

transformers = pytest.importorskip("transformers")


def read_all(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_tiny_checkpoint_loads_and_generates(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (tiny / "model.safetensors").is_file() and (tiny / "config.json").is_file()
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok("Hello, world! weightcache")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, world! weightcache"
    assert (tok.unk_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 2, 3)
    assert len(tok) <= cfg["vocab_size"]
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    # the checkpoint is exactly what the model holds
    sd = model.state_dict()
    for k, v in read_all(tiny).items():
        assert torch.equal(sd[k], v), k
    out = model.generate(**tok("hello", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(tok("hello")["input_ids"]) + 4
    # chat template renders
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "user: hi" in text


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny):
    again = make_llama_checkpoint(tmp_path / "a")
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    other = make_llama_checkpoint(tmp_path / "b", seed=1)
    a, b = read_all(tiny), read_all(other)
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_sharded_tied_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    p = make_llama_checkpoint(tmp_path / "m", dtype=torch.bfloat16, tie_word_embeddings=True, max_shard_bytes=40_000)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((p / s).is_file() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]
    tensors = read_all(p)
    assert set(tensors) == set(index["weight_map"])
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    m = AutoModelForCausalLM.from_pretrained(p)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("shard", [None, 50_000])
def test_direct_writer_matches_model_names_and_loads(tmp_path, shard):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(hidden_size=64, num_layers=3, intermediate_size=96, num_heads=4, num_kv_heads=1, vocab_size=300)
    p = make_llama_checkpoint(tmp_path / "d", dtype=torch.bfloat16, direct=True, max_shard_bytes=shard, **kw)
    tensors = read_all(p)
    shapes = llama_param_shapes(**kw)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert sum(v.numel() * v.element_size() for v in tensors.values()) == estimate_llama_bytes(dtype=torch.bfloat16, **kw)
    assert (p / "model.safetensors.index.json").exists() == (shard is not None)
    for v in tensors.values():
        assert torch.isfinite(v.float()).all()
        assert v.float().abs().max() < 2
    # norms are near one, projections small and not all equal
    assert 0.8 < tensors["model.norm.weight"].float().mean() < 1.2
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    assert q.std() > 0.01 and not torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].float())
    m = AutoModelForCausalLM.from_pretrained(p)
    tok = AutoTokenizer.from_pretrained(p)
    assert m.dtype == torch.bfloat16
    sd = m.state_dict()
    for k, v in tensors.items():
        assert torch.equal(sd[k], v)
    m.generate(**tok("hi", return_tensors="pt"), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("target", [1 << 20, 50 << 20, 300 << 20, 4 << 30, 16 << 30, 80 << 30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_for_bytes_hits_target(target, dtype):
    kw = llama_config_for_bytes(target, dtype)
    got = estimate_llama_bytes(dtype=dtype, **kw)
    assert abs(got - target) / target < 0.15, (kw, got)
    assert kw["hidden_size"] % kw["num_heads"] == 0 and kw["num_heads"] % kw["num_kv_heads"] == 0
    assert kw["vocab_size"] >= 260


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="divisible by num_heads"):
        make_llama_checkpoint(tmp_path, hidden_size=60, num_heads=8)
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        make_llama_checkpoint(tmp_path, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="at least 260"):
        make_llama_checkpoint(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="num_layers"):
        make_llama_checkpoint(tmp_path, num_layers=0)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        make_llama_checkpoint(tmp_path, max_shard_bytes=0)
    with pytest.raises(ValueError, match="target_bytes"):
        llama_config_for_bytes(0)
    with pytest.raises(ValueError, match="direct writing supports"):
        make_llama_checkpoint(tmp_path / "i", dtype=torch.int8, direct=True)


def test_default_head_dim_fits_vllm_cpu(tmp_path):
    from transformers import AutoConfig

    p = make_llama_checkpoint(tmp_path / "h", direct=True)
    cfg = AutoConfig.from_pretrained(p)
    assert cfg.head_dim == 32 and cfg.num_attention_heads == 4
    assert tuple(read_all(p)["model.layers.0.self_attn.q_proj.weight"].shape) == (128, 64)
    with pytest.raises(ValueError, match="head_dim"):
        make_llama_checkpoint(tmp_path / "x", head_dim=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generates_what_transformers_generates(tiny):
    """vLLM (in its own process: an engine changes process-wide torch state) loads the checkpoint and
    generates what transformers does."""
    pytest.importorskip("vllm")
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runner = str(Path(__file__).parent / "vllm_runner.py")
    spec = {"model": str(tiny), "dtype": "float32", "prompts": ["hello world"], "max_tokens": 5}
    r = subprocess.run([sys.executable, runner, json.dumps(spec)], capture_output=True, text=True, env=env,
                       timeout=420)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(lines[0][7:])["tokens"][0]
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok("hello world", return_tensors="pt")
    want = AutoModelForCausalLM.from_pretrained(tiny).generate(**ids, max_new_tokens=5, do_sample=False)
    assert got == want[0, ids["input_ids"].shape[1]:].tolist()


def test_moe_checkpoint_written_directly_loads_like_a_saved_one(tmp_path):
    """The benchmark's MoE checkpoints are written shard by shard; transformers loads them (experts fused)."""
    from transformers import AutoModelForCausalLM

    from weightcache.testing.checkpoints import make_moe_checkpoint

    direct = make_moe_checkpoint(tmp_path / "d", "qwen3_moe", direct=True, max_shard_bytes=200_000)
    saved = make_moe_checkpoint(tmp_path / "s", "qwen3_moe")
    a, b = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (direct, saved))
    assert {n: (t.shape, t.dtype) for n, t in a.state_dict().items()} == \
        {n: (t.shape, t.dtype) for n, t in b.state_dict().items()}
    assert (direct / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.isfinite(a(torch.tensor([[1, 2, 3]])).logits).all()
