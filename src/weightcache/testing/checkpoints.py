"""Random-weight Llama checkpoints (with a local tokenizer) for tests, demos and benchmarks.

Small models are built with transformers (``LlamaForCausalLM`` + ``save_pretrained``); large ones are
written directly, shard by shard, so a "~16 GB" model never sits in RAM. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from ..dtypes import safetensors_code

# Above this many bytes the model is written directly instead of instantiated.
DIRECT_WRITE_BYTES = 1 << 30
DEFAULT_SHARD_BYTES = 4 << 30

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # byte-level alphabet + specials
MIN_HEAD_DIM = 32  # vLLM's CPU attention has no kernels for smaller heads

_CORPUS = """\
weightcache keeps model weights resident in GPU memory across inference engine restarts.
A daemon per rank loads the weights once and holds them; engines attach them in milliseconds.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a small model that learned to count: one two three four five six seven
eight nine ten eleven twelve. 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
def main():\n    print("hello")\n    return 0\n
The tensor is sharded column-wise across ranks; the row-wise projection is reduced with an all-reduce.
"""


def _training_text() -> list[str]:
    return _CORPUS.splitlines() * 4


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _validate(hidden_size, num_layers, intermediate_size, num_heads, num_kv_heads, vocab_size) -> None:
    for name, v in [
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("intermediate_size", intermediate_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("vocab_size", vocab_size),
    ]:
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be at least {MIN_VOCAB} (256 byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens of the byte-level tokenizer)"
        )


def _head_dim(hidden_size: int, num_heads: int, head_dim: int | None) -> int:
    """hidden_size / num_heads, but at least MIN_HEAD_DIM unless given explicitly."""
    if head_dim is None:
        return max(hidden_size // num_heads, MIN_HEAD_DIM)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return head_dim


def llama_config(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 2048,
    head_dim: int | None = None,
):
    """The ``LlamaConfig`` that :func:`make_llama_checkpoint` writes."""
    from transformers import LlamaConfig

    _validate(hidden_size, num_layers, intermediate_size, num_heads, num_kv_heads, vocab_size)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        head_dim=_head_dim(hidden_size, num_heads, head_dim),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        unk_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype=dtype,
    )


def llama_param_shapes(
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of ``LlamaForCausalLM`` (as ``save_pretrained`` writes them)."""
    _validate(hidden_size, num_layers, intermediate_size, num_heads, num_kv_heads, vocab_size)
    h, i = hidden_size, intermediate_size
    hd = _head_dim(hidden_size, num_heads, head_dim)
    q = num_heads * hd
    kv = num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def estimate_llama_bytes(*, dtype: torch.dtype = torch.bfloat16, **shape_kwargs) -> int:
    """Bytes of the checkpoint's tensors for the given shape kwargs (see :func:`llama_param_shapes`)."""
    shapes = llama_param_shapes(**shape_kwargs)
    return sum(math.prod(s) for s in shapes.values()) * _dtype_size(dtype)


def llama_config_for_bytes(target_bytes: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Shape kwargs for :func:`make_llama_checkpoint` whose tensors total about ``target_bytes``.

    The hidden size grows with the target (Llama-like proportions); the layer count is then fitted.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    esz = _dtype_size(dtype)
    params = target_bytes // esz
    if params <= 1 << 20:
        h, heads, kvh, vocab = 64, 2, 1, 512
    elif params <= 16 << 20:
        h, heads, kvh, vocab = 256, 4, 2, 2048
    elif params <= 128 << 20:
        h, heads, kvh, vocab = 512, 8, 2, 8192
    elif params <= 1 << 30:
        h, heads, kvh, vocab = 1024, 8, 2, 16384
    elif params <= 6 << 30:
        h, heads, kvh, vocab = 2048, 16, 4, 32768
    elif params <= 32 << 30:
        h, heads, kvh, vocab = 4096, 32, 8, 32768
    else:
        h, heads, kvh, vocab = 8192, 64, 8, 32768
    inter = max(32, int(round(h * 3.5 / 32)) * 32)
    kw = dict(hidden_size=h, intermediate_size=inter, num_heads=heads, num_kv_heads=kvh, vocab_size=vocab)
    one = estimate_llama_bytes(dtype=dtype, num_layers=1, **kw)
    per_layer = estimate_llama_bytes(dtype=dtype, num_layers=2, **kw) - one
    layers = max(1, round((target_bytes - (one - per_layer)) / per_layer))
    return dict(kw, num_layers=layers)


def make_tokenizer(path: str | Path, vocab_size: int):
    """Train a small byte-level BPE tokenizer on built-in text and save it (HF fast-tokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size ({vocab_size}) must be at least {MIN_VOCAB} for the byte-level tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(path))
    return fast


def make_llama_checkpoint(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    direct: bool | None = None,
    head_dim: int | None = None,
    sparse: bool = False,
) -> Path:
    """Write a random-weight Llama checkpoint plus tokenizer into ``path`` and return it.

    ``max_shard_bytes`` splits the weights into shards with ``model.safetensors.index.json``.
    ``head_dim`` defaults to ``hidden_size // num_heads`` but at least 32 (vLLM's CPU attention needs it),
    so the default tiny model has 4 heads of 32 (q_proj 128 x 64).
    ``direct`` (default: automatic, above 1 GiB) writes random tensors shard by shard instead of
    instantiating ``LlamaForCausalLM``; both layouts load with ``from_pretrained`` and vLLM. ``sparse`` writes
    real headers over holes (every weight zero): a checkpoint of any size in no time and, on tmpfs, no memory
    (for measuring memory at scale, not tokens).
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shape_kwargs = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=head_dim,
    )
    config = llama_config(**shape_kwargs, dtype=dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    total = estimate_llama_bytes(dtype=dtype, **shape_kwargs)
    if direct is None:
        direct = total > DIRECT_WRITE_BYTES
    if direct or sparse:
        from transformers import GenerationConfig

        config.save_pretrained(str(path))
        GenerationConfig.from_model_config(config).save_pretrained(str(path))
        shapes = llama_param_shapes(**shape_kwargs)
        _write_random_shards(path, shapes, dtype, seed, max_shard_bytes or DEFAULT_SHARD_BYTES, sparse=sparse)
    else:
        _save_with_transformers(path, config, dtype, seed, max_shard_bytes)
    make_tokenizer(path, vocab_size)
    return path


MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


def moe_config(arch: str = "qwen3_moe", *, hidden_size: int = 128, num_layers: int = 2, num_experts: int = 4,
               experts_per_token: int = 2, moe_intermediate_size: int = 64, num_heads: int = 2,
               num_kv_heads: int = 1, head_dim: int = 64, vocab_size: int = 512):
    """A small Mixture-of-Experts config of a family that transformers and vLLM both run."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    _validate(hidden_size, num_layers, moe_intermediate_size, num_heads, num_kv_heads, vocab_size)
    common = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                  num_experts_per_tok=experts_per_token, max_position_embeddings=4096,
                  bos_token_id=SPECIAL_TOKENS.index("<s>"), eos_token_id=SPECIAL_TOKENS.index("</s>"))
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=4 * moe_intermediate_size, moe_intermediate_size=moe_intermediate_size,
                              num_experts=num_experts, decoder_sparse_step=1, mlp_only_layers=[], **common)
    if arch == "mixtral":
        return MixtralConfig(intermediate_size=moe_intermediate_size, num_local_experts=num_experts, **common)
    raise ValueError(f"unknown MoE architecture {arch!r}; known: {', '.join(MOE_ARCHITECTURES)}")


def qwen3_moe_param_shapes(config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of ``Qwen3MoeForCausalLM`` (one tensor per expert, as shipped)."""
    h, hd, v = config.hidden_size, config.head_dim, config.vocab_size
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate.weight": (config.num_experts, h)})
        for e in range(config.num_experts):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (inter, h), x + "up_proj.weight": (inter, h),
                           x + "down_proj.weight": (h, inter)})
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def make_moe_checkpoint(path: str | Path, arch: str = "qwen3_moe", *, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0, direct: bool = False, max_shard_bytes: int | None = None, **shape) -> Path:
    """Write a random-weight MoE checkpoint (Hugging Face layout, one tensor per expert) plus tokenizer.
    ``direct`` (qwen3_moe) writes random shards without instantiating the model (benchmark sizes)."""
    config = moe_config(arch, **shape)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if direct:
        if arch != "qwen3_moe":
            raise ValueError(f"direct writing supports qwen3_moe, not {arch!r}")
        from transformers import GenerationConfig

        config.dtype = dtype
        config.save_pretrained(str(path))
        GenerationConfig.from_model_config(config).save_pretrained(str(path))
        _write_random_shards(path, qwen3_moe_param_shapes(config), dtype, seed, max_shard_bytes or DEFAULT_SHARD_BYTES)
    else:
        _save_with_transformers(path, config, dtype, seed, max_shard_bytes)
    make_tokenizer(path, config.vocab_size)
    return path


# Small configs of the families the transformers engine is tested with (random weights, made locally).
FAMILIES = ("llama_rope_scaled", "qwen2_tied", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe", "deepseek_v3")


def family_config(family: str, *, hidden_size: int = 128, num_layers: int = 2, intermediate_size: int = 256,
                  num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, vocab_size: int = 512,
                  num_experts: int = 4, experts_per_token: int = 2, moe_intermediate_size: int = 64):
    """A small config of one of FAMILIES (dense, MoE, or DeepSeek-V3's MLA + shared experts)."""
    import transformers as hf

    _validate(hidden_size, num_layers, intermediate_size, num_heads, num_kv_heads, vocab_size)
    common = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, vocab_size=vocab_size, intermediate_size=intermediate_size,
                  max_position_embeddings=4096, bos_token_id=SPECIAL_TOKENS.index("<s>"),
                  eos_token_id=SPECIAL_TOKENS.index("</s>"))
    if family in ("qwen3_moe", "mixtral"):
        return moe_config(family, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts,
                          experts_per_token=experts_per_token, moe_intermediate_size=moe_intermediate_size,
                          num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size)
    if family == "llama_rope_scaled":
        return hf.LlamaConfig(head_dim=head_dim, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}, **common)
    if family == "qwen2_tied":
        return hf.Qwen2Config(tie_word_embeddings=True, **common)
    if family == "qwen3":
        return hf.Qwen3Config(head_dim=head_dim, **common)
    if family == "gemma2":  # sliding window on alternate layers, logit soft-capping, tied embeddings
        return hf.Gemma2Config(head_dim=head_dim, sliding_window=4, **common)
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return hf.Phi3Config(**{k: v for k, v in common.items() if k != "bos_token_id"}, bos_token_id=1,
                             pad_token_id=SPECIAL_TOKENS.index("<pad>"))
    if family == "deepseek_v3":  # MLA attention, a dense first layer, routed + shared experts
        return hf.DeepseekV3Config(
            q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            n_routed_experts=num_experts, n_shared_experts=1, num_experts_per_tok=experts_per_token,
            moe_intermediate_size=moe_intermediate_size, first_k_dense_replace=1, n_group=1, topk_group=1,
            **{**common, "num_key_value_heads": num_heads})
    raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")


def make_checkpoint(path: str | Path, family: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    **shape) -> Path:
    """Write a random-weight checkpoint of one of FAMILIES (Hugging Face layout) plus tokenizer."""
    config = family_config(family, **shape)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _save_with_transformers(path, config, dtype, seed, None)
    make_tokenizer(path, config.vocab_size)
    return path




def _save_with_transformers(path: Path, config, dtype: torch.dtype, seed: int, max_shard_bytes) -> None:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # Norm weights init to ones; perturb them so tests can tell tensors apart.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.02)
    model = model.to(dtype)
    kwargs = {"safe_serialization": True}
    if max_shard_bytes is not None:
        kwargs["max_shard_size"] = int(max_shard_bytes)
    try:
        model.save_pretrained(str(path), **kwargs)
    except TypeError:  # transformers without the safe_serialization switch (always safetensors)
        kwargs.pop("safe_serialization")
        model.save_pretrained(str(path), **kwargs)


_DIRECT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _random_chunks(pool: torch.Tensor, nbytes: int, gen: torch.Generator) -> Iterator[memoryview]:
    """``nbytes`` of tensor data taken from a random pool at random offsets (fast, sane values)."""
    raw = pool.view(torch.uint8)
    esz = pool.element_size()
    left = nbytes
    while left:
        start = int(torch.randint(0, pool.numel() // 2, (1,), generator=gen)) * esz
        n = min(left, raw.numel() - start)
        yield memoryview(raw[start : start + n].numpy())
        left -= n


# A tensor written by a caller's own bytes: (dtype, shape, fill(nbytes, generator) -> chunks)
Special = tuple[torch.dtype, tuple[int, ...], Callable[[int, torch.Generator], Iterable[memoryview]]]


def _write_random_shards(
    path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int, max_shard_bytes: int,
    sparse: bool = False, specials: dict[str, Special] | None = None,
) -> None:
    """Random ``dtype`` tensors of ``shapes`` (norms near 1), shard by shard in their order; the ones named in
    ``specials`` have their own dtype and bytes (packed integers, scales)."""
    if dtype not in _DIRECT_DTYPES:
        raise ValueError(f"direct writing supports {sorted(str(d) for d in _DIRECT_DTYPES)}, got {dtype}")
    gen = torch.Generator().manual_seed(seed)
    pool_elems = 16 << 20
    pool = (torch.randn(pool_elems, generator=gen) * 0.02).to(dtype)
    norms = {n for n in shapes if n.endswith("norm.weight")}

    def plain_fill(name: str) -> Callable[[int, torch.Generator], Iterable[memoryview]]:
        if name in norms:
            return lambda _n, g: [memoryview((1.0 + 0.02 * torch.randn(shapes[name], generator=g)).to(
                dtype).view(torch.uint8).numpy())]
        return lambda n, g: _random_chunks(pool, n, g)

    specials = specials or {}
    tensors = {name: specials.get(name) or (dtype, shape, plain_fill(name)) for name, shape in shapes.items()}
    sizes = {name: math.prod(shape) * _dtype_size(dt) for name, (dt, shape, _) in tensors.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for idx, names in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for name in names:
            dt, shape, _ = tensors[name]
            header[name] = {"dtype": safetensors_code(dt), "shape": list(shape), "data_offsets": [off, off + sizes[name]]}
            off += sizes[name]
            weight_map[name] = fname
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        hbytes += b" " * (-len(hbytes) % 8)  # data starts 8-byte aligned
        tmp = path / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
            if sparse:
                f.truncate(8 + len(hbytes) + off)
                names = []
            for name in names:
                for chunk in tensors[name][2](sizes[name], gen):
                    f.write(chunk)
        os.replace(tmp, path / fname)
        total += off
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


