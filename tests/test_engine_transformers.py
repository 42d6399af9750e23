"""weightcache.transformers.from_pretrained: the same model as transformers builds, without reading the weights."""

import ctypes
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import weightcache as wc
import weightcache.transformers as wct
from weightcache.daemon import Daemon
from weightcache.digests import checkpoint_digest, config_digest
from weightcache.dtypes import dtype_name
from weightcache.integrations.model_state import parity, python_state, reachable_tensors
from weightcache.integrations.torch import BindError
from weightcache.integrations.transformers.compat import META_NAME, RULES, UnsupportedModel
from weightcache.integrations.transformers.producer import TransformersSource, build_model, capture
from weightcache.preload.layout import Placement
from weightcache.sockets import device_tag, socket_path
from weightcache.sources.safetensors import SafetensorsSource
from weightcache.testing.checkpoints import FAMILIES, make_checkpoint, make_llama_checkpoint
from weightcache.testing.quantized import make_compressed_fp8_checkpoint, make_fp8_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[1, 17, 42, 99, 7, 250]]


@pytest.fixture(scope="module", autouse=True)
def digest_cache(tmp_path_factory):
    """Checkpoint digests are remembered under XDG_CACHE_HOME: keep them out of the user's home."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    return {
        "untied": make_llama_checkpoint(base / "untied", seed=1),
        "tied": make_llama_checkpoint(base / "tied", tie_word_embeddings=True, seed=2),
    }


def placement(device="cpu") -> Placement:
    return Placement("main", 0, 0, 0, False, 0, 1, 0, 0, str(device), 1, 1, 1)


def serve(ckpt, sockdir, *, dtype=None, device="cpu", edit=None, key=None, **source_args) -> Daemon:
    """A daemon holding what transformers' from_pretrained builds, as preload does for engine "transformers";
    ``edit(tensors, roles)`` changes the captured tensors before they are packed."""
    src = TransformersSource(placement(device), path=str(ckpt), dtype=dtype or "auto", **source_args)
    key = key or src.key("dp1-pp1-tp1")
    d = Daemon(socket_path(sockdir, key, device_tag(device)), key, device=device)
    d.start()
    if edit is None:
        src.produce(d)
    else:
        model, seen = build_model(ckpt, dtype=src.dtype, device=torch.device(device))
        tensors, roles = capture(model, seen.before, seen.after, seen.conversions_used)
        edit(tensors, roles)
        d.load_tensors(tensors, roles)
    return d


def engine_state(model) -> dict:
    """Every tensor the model's forward reads, by every name (parameters, buffers, tensor attributes)."""
    return reachable_tensors(model, RULES)[0]


def assert_same_model(model, ref, prompt=PROMPT):
    """The attached model is transformers' own: same class, every tensor it reads byte-identical (names,
    dtypes, shapes, gradients flags), same logits bit for bit."""
    assert type(model) is type(ref) and model.training == ref.training
    assert parity(engine_state(ref), engine_state(model)) == []
    grads = {n: p.requires_grad for n, p in ref.named_parameters()}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    ids = torch.tensor(prompt, device=ref.device)
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert a.dtype == b.dtype and torch.equal(a, b)


def greedy(model, n=12):
    ids = torch.tensor(PROMPT, device=model.device)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n).cpu()


def reference(ckpt, device="cpu", dtype=None):
    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype or "auto").to(device)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_same_greedy_tokens_and_logits_as_transformers(ckpts, sockdir, which):
    ckpt = ckpts[which]
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        assert model._weightcache_source == "attach"
        att = model._weightcache_attachment
        emb = model.model.embed_tokens.weight
        assert emb.data_ptr() == att["model.embed_tokens.weight"].data_ptr()  # zero-copy
        ref = reference(ckpt)
        assert not model.training
        assert_same_model(model, ref)
        ref_sd = ref.state_dict()
        for name, t in model.state_dict().items():
            assert t.dtype == ref_sd[name].dtype and torch.equal(t, ref_sd[name]), name
        rot = model.model.rotary_emb
        assert torch.equal(rot.inv_freq, ref.model.rotary_emb.inv_freq) and not rot.inv_freq.is_meta
        ids = torch.tensor(PROMPT)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        assert torch.equal(greedy(model), greedy(ref))
        if which == "tied":
            assert model.lm_head.weight is emb  # tied embeddings stay tied
            assert "lm_head.weight" not in att  # the checkpoint stores them once
        else:
            assert model.lm_head.weight is not emb


def test_the_engine_initialises_nothing_every_tensor_is_the_daemons(ckpts, sockdir, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    ckpt = ckpts["untied"]
    ref = reference(ckpt)
    with serve(ckpt, sockdir):
        def no_init(self, module):
            raise AssertionError("the attach path must not initialise anything")

        monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", no_init)
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        att = model._weightcache_attachment
        assert att.roles["model.rotary_emb.inv_freq"] == "nonpersistent_buffer"
        assert model.model.rotary_emb.inv_freq.data_ptr() == att["model.rotary_emb.inv_freq"].data_ptr()
        for name in ("inv_freq", "original_inv_freq"):
            assert torch.equal(getattr(model.model.rotary_emb, name), getattr(ref.model.rotary_emb, name)), name
        assert set(model._weightcache_timings) == {"key", "attach", "skeleton", "bind", "rest"}


def test_bf16_from_fp32_checkpoint_casts_like_transformers(ckpts, sockdir):
    ckpt = ckpts["untied"]
    with serve(ckpt, sockdir, dtype=torch.bfloat16):
        model = wct.from_pretrained(ckpt, device="cpu", dtype=torch.bfloat16, socket_dir=sockdir, fallback=False)
        ref = reference(ckpt, dtype=torch.bfloat16)
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        assert torch.equal(greedy(model), greedy(ref))


INOTIFY_CHILD = r"""
import sys, torch
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" and args and isinstance(args[0], str) else None)
import weightcache.transformers as wct
m = wct.from_pretrained({ckpt!r}, device="cpu", socket_dir={sockdir!r}, fallback=False)
assert m._weightcache_source == "attach", m._weightcache_source
with torch.no_grad():
    out = m.generate(torch.tensor({prompt!r}), max_new_tokens=12, min_new_tokens=12, do_sample=False)
bad = [p for p in opened if p.endswith(".safetensors")]
assert not bad, bad
print("TOKENS", out[0].tolist())
"""

IN_OPEN, IN_ACCESS = 0x20, 0x1


class Inotify:
    """Every open (any process, Python or not) of a file in a directory, read through inotify."""

    def __init__(self, directory):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"inotify unavailable (errno {ctypes.get_errno()})")
        if self.libc.inotify_add_watch(self.fd, str(directory).encode(), IN_OPEN | IN_ACCESS) < 0:
            pytest.skip(f"inotify_add_watch failed (errno {ctypes.get_errno()})")

    def events(self) -> list[tuple[int, str]]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, i)
                out.append((mask, buf[i + 16:i + 16 + n].rstrip(b"\0").decode()))
                i += 16 + n

    def close(self):
        os.close(self.fd)


def test_checkpoint_weight_files_are_not_opened_on_the_attach_path(ckpts, sockdir):
    ckpt = ckpts["untied"]
    with serve(ckpt, sockdir):
        watch = Inotify(ckpt)
        try:
            code = INOTIFY_CHILD.format(ckpt=str(ckpt), sockdir=sockdir, prompt=PROMPT)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
            assert out.returncode == 0, out.stdout + out.stderr
            attach_events = watch.events()
            opened = {name for mask, name in attach_events if mask & IN_OPEN}
            assert "config.json" in opened  # the watch sees the engine's reads...
            assert not [n for n in opened if n.endswith(".safetensors")], attach_events  # ...but no weights
            ref = reference(ckpt)  # control: transformers' own loader does open them
            assert "model.safetensors" in {name for mask, name in watch.events() if mask & IN_OPEN}
        finally:
            watch.close()
        tokens = json.loads(out.stdout.split("TOKENS", 1)[1])
        assert tokens == greedy(ref)[0].tolist()


def test_attaches_what_weightcache_preload_serves(ckpts, sockdir, tmp_path):
    """The key preload (engine "transformers") computes is the key from_pretrained looks for."""
    ckpt = ckpts["tied"]
    log = open(tmp_path / "preload.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(ckpt), "--device", "cpu",
         "--weight-cache-socket-dir", sockdir],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = ""
        while "READY" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, (tmp_path / "preload.log").read_text()
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        assert model._weightcache_source == "attach"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(greedy(model), greedy(reference(ckpt)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_fallback_loads_from_disk_with_a_warning(ckpts, sockdir):
    ckpt = ckpts["tied"]
    with pytest.warns(wct.NoDaemonWarning, match="loading .* from disk: no weight cache daemon holds"):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir)
    assert model._weightcache_source == "disk"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(greedy(model), greedy(reference(ckpt)))


def test_no_fallback_error_names_the_socket(ckpts, sockdir):
    ckpt = ckpts["untied"]
    want = socket_path(sockdir, wct.key_for_checkpoint(ckpt), "cpu")
    with pytest.raises(wc.DaemonUnavailable, match="weightcache preload") as e:
        wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
    assert str(want) in str(e.value)


def test_other_dtype_in_the_daemon_is_a_key_mismatch(ckpts, sockdir):
    ckpt = ckpts["untied"]
    with serve(ckpt, sockdir):  # float32
        with pytest.raises(wc.KeyMismatch, match="dtype: engine expects 'bfloat16', daemon holds 'float32'"):
            wct.from_pretrained(ckpt, device="cpu", dtype="bfloat16", socket_dir=sockdir, fallback=False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model = wct.from_pretrained(ckpt, device="cpu", dtype="bfloat16", socket_dir=sockdir)
        assert model._weightcache_source == "disk" and model.dtype == torch.bfloat16
        assert any(issubclass(x.category, wct.NoDaemonWarning) and "dtype" in str(x.message) for x in w)


def test_missing_tensor_in_the_cache_is_a_clear_error(ckpts, sockdir):
    ckpt = ckpts["untied"]

    def drop(tensors, roles):
        del tensors["model.layers.1.mlp.down_proj.weight"]

    with serve(ckpt, sockdir, edit=drop):
        with pytest.raises(BindError, match=r"the cache lacks 1 tensor\(s\) this model reads, e\.g\. "
                                            r"model\.layers\.1\.mlp\.down_proj\.weight"):
            wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir)  # not hidden by the fallback


def test_wrong_dtype_in_the_cache_is_a_clear_error(ckpts, sockdir):
    ckpt = ckpts["untied"]

    def half(tensors, roles):
        tensors["model.norm.weight"] = tensors["model.norm.weight"].half()

    with serve(ckpt, sockdir, edit=half):
        with pytest.raises(BindError, match=r"model.norm.weight is torch.float16\[64\] but the model builds "
                                            r"torch.float32\[64\]"):
            wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir)


def test_a_daemon_of_raw_checkpoint_tensors_is_refused_clearly(ckpts, sockdir):
    ckpt = ckpts["untied"]
    key = wct.key_for_checkpoint(ckpt)
    with Daemon(socket_path(sockdir, key, "cpu"), key) as d:
        d.start()
        d.load(SafetensorsSource(ckpt, progress=False))
        with pytest.raises(wc.WeightCacheError, match="holds raw checkpoint tensors, not the model transformers'"):
            wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir)


def test_copy_mode_gives_a_trainable_private_model(ckpts, sockdir):
    ckpt = ckpts["untied"]
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, mode="copy", fallback=False)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.tensor(PROMPT)
        model(ids, labels=ids).loss.backward()
        opt.step()
        shared = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        ref = reference(ckpt)
        assert not torch.equal(model.lm_head.weight, ref.lm_head.weight)
        assert torch.equal(shared.lm_head.weight, ref.lm_head.weight)  # the daemon's bytes are untouched


def test_key_for_checkpoint(ckpts, tmp_path):
    ckpt = ckpts["untied"]
    key = wct.key_for_checkpoint(ckpt)
    assert key.model == str(Path(ckpt).resolve())
    assert key.content_digest == checkpoint_digest(ckpt)
    assert (key.dtype, key.engine, key.layout, key.rank, key.role) == ("float32", "transformers", "dp1-pp1-tp1", 0, "main")
    assert key.quantization == "none" and key.engine_version == wct.engine_version() != ""
    assert wct.key_for_checkpoint(ckpt, dtype="auto") == key
    assert wct.key_for_checkpoint(ckpt, dtype=torch.float32) == key
    assert wct.key_for_checkpoint(ckpt, dtype="bfloat16").dtype == "bfloat16"
    k2 = wct.key_for_checkpoint(ckpt, layout="dp1-pp1-tp2", rank=1, role="draft")
    assert (k2.layout, k2.rank, k2.role) == ("dp1-pp1-tp2", 1, "draft")
    assert k2.short_hash() != key.short_hash()
    # SafetensorsSource reports the same identity fields
    fields = SafetensorsSource(ckpt, dtype=torch.float32, progress=False).key_fields()
    assert (fields["model"], fields["content_digest"], fields["dtype"]) == (key.model, key.content_digest, key.dtype)
    # a Hugging Face snapshot directory carries its commit; a config without dtype falls back to the weights
    snap = tmp_path / "models--org--m" / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (snap / "config.json").write_text(json.dumps(cfg))
    (snap / "model.safetensors").symlink_to(Path(ckpt) / "model.safetensors")
    k3 = wct.key_for_checkpoint(snap)
    assert k3.revision == "ab" * 20 and k3.dtype == "float32"
    assert k3.quantization == config_digest(cfg["quantization_config"]) != "none"
    assert wct.key_for_checkpoint(snap, revision="main").revision == "main"
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        wct.key_for_checkpoint(ckpt, dtype="float99")
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        wct.key_for_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        wct.key_for_checkpoint(tmp_path)
    assert dtype_name(wct.resolve_dtype(ckpt, "auto")) == "float32"


# ---- every causal LM transformers loads: MoE, quantized, dense families -------------------------------------


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {f: make_checkpoint(base / f, f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_transformers_own_model(families, sockdir, family):
    """MoE (fused experts via transformers' weight conversions), DeepSeek-V3 (MLA, shared experts), and the
    dense families: every tensor the forward reads and the logits are those of a disk load."""
    ckpt = families[family]
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        assert model._weightcache_source == "attach"
        assert_same_model(model, reference(ckpt))
        if family in ("mixtral", "qwen3_moe"):  # experts fused at load time, served fused
            experts = model.model.layers[0].mlp.experts
            assert experts.gate_up_proj.data_ptr() == model._weightcache_attachment[
                "model.layers.0.mlp.experts.gate_up_proj"].data_ptr()
            assert len(model._weight_conversions) == len(reference(ckpt)._weight_conversions) > 0
        if family in ("qwen2_tied", "gemma2"):
            assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints through accelerate")
    base = tmp_path_factory.mktemp("fp8")
    return {"qwen3": make_fp8_checkpoint(base / "qwen3", "qwen3", hidden_size=256, intermediate_size=384),
            "qwen3_moe": make_fp8_checkpoint(base / "qwen3_moe", "qwen3_moe", hidden_size=256,
                                             moe_intermediate_size=128)}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fp8_block_checkpoint_on_cpu_is_what_transformers_makes_of_it(fp8, sockdir, family):
    """An FP8 block-128 checkpoint (weight_scale_inv per 128 x 128 tile): on a machine without an FP8 GPU
    transformers' quantizer dequantizes it while loading (the daemon does exactly that); the key says so."""
    ckpt = fp8[family]
    with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert w.dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv").shape == (1, 2)  # 128 x 256
    key = wct.key_for_checkpoint(ckpt, device="cpu")
    raw = json.loads((Path(ckpt) / "config.json").read_text())["quantization_config"]
    assert key.quantization not in ("none", config_digest(raw))  # dequantize=True, as the quantizer settled it
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        ref = reference(ckpt)
        assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
        assert_same_model(model, ref)
        assert not hasattr(model.config, "quantization_config") and not model.is_quantized  # as transformers


def test_compressed_tensors_fp8_checkpoint(tmp_path, sockdir):
    """compressed-tensors ("float-quantized" FP8 weights with per-channel scales, as llm-compressor writes
    them): the modules transformers' quantizer prepares, the tensors and the logits of a disk load."""
    pytest.importorskip("compressed_tensors", reason="transformers loads these through compressed-tensors")
    ckpt = make_compressed_fp8_checkpoint(tmp_path / "ct", "qwen3", hidden_size=256, intermediate_size=384)
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        q = model.model.layers[0].self_attn.q_proj
        assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (128, 1)
        assert q.weight.data_ptr() == model._weightcache_attachment["model.layers.0.self_attn.q_proj.weight"].data_ptr()
        assert_same_model(model, reference(ckpt))


def test_attention_implementation_is_the_engines_choice(families, sockdir):
    """Weights do not depend on the attention implementation: an eager engine attaches an sdpa daemon."""
    ckpt = families["qwen3"]
    with serve(ckpt, sockdir, attn_implementation="sdpa"):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False,
                                    attn_implementation="eager")
        assert model.config._attn_implementation == "eager"
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager")
        assert_same_model(model, ref)


class _Kernel:  # an object loading might leave on a module
    pass


def test_python_state_loading_set_is_reapplied_and_other_objects_are_refused(families, sockdir):
    ckpt = families["qwen3"]
    model, seen = build_model(ckpt, dtype=torch.bfloat16, device=torch.device("cpu"))
    mlp = model.model.layers[1].mlp
    mlp.scale_hint, mlp.fused = 0.25, True  # host-side scalars set by loading
    del model.model.layers[0].mlp.act_fn.__dict__["_is_hf_initialized"]
    now = python_state(model, RULES)  # what loading left (seen.after), with these changes
    after = {**seen.after, **{p: now[p] for p in ("model.layers.1.mlp", "model.layers.0.mlp.act_fn")}}
    tensors, roles = capture(model, seen.before, after, seen.conversions_used)
    meta = json.loads(bytes(tensors[META_NAME].numpy()))
    assert meta["scalars"]["model.layers.1.mlp.scale_hint"] == {"v": 0.25}
    key = wct.key_for_checkpoint(ckpt)
    with Daemon(socket_path(sockdir, key, "cpu"), key) as d:
        d.start()
        d.load_tensors(tensors, roles)
        attached = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        assert (attached.model.layers[1].mlp.scale_hint, attached.model.layers[1].mlp.fused) == (0.25, True)
        assert "_is_hf_initialized" not in vars(attached.model.layers[0].mlp.act_fn)
    model.model.layers[0].self_attn.kernel = _Kernel()
    after["model.layers.0.self_attn"] = python_state(model, RULES)["model.layers.0.self_attn"]
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.0\.self_attn\.kernel \(_Kernel\)"):
        capture(model, seen.before, after)


def test_bad_arguments(ckpts, sockdir, tmp_path):
    with pytest.raises(ValueError, match="mode"):
        wct.from_pretrained(ckpts["untied"], mode="mmap", socket_dir=sockdir)
    with pytest.raises(FileNotFoundError):
        wct.from_pretrained(tmp_path / "missing", socket_dir=sockdir)
    with pytest.raises(TypeError, match="dtype"):
        wct.from_pretrained(ckpts["untied"], dtype=3, socket_dir=sockdir)
    with pytest.raises(wc.WeightCacheError, match="a tensor parallel engine runs in a torch.distributed world of 2"):
        wct.from_pretrained(ckpts["untied"], layout="dp1-pp1-tp2", rank=1, socket_dir=sockdir)
    with pytest.raises(wc.WeightCacheError, match="layout dp1-pp2-tp1: from_pretrained binds whole models"):
        wct.from_pretrained(ckpts["untied"], layout="dp1-pp2-tp1", socket_dir=sockdir)


def test_module_attribute_access():
    code = ("import sys, weightcache; assert 'transformers' not in sys.modules; "
            "from weightcache.integrations.transformers import engine as e; from weightcache.integrations import torch as t; "
            "assert weightcache.transformers.from_pretrained is e.from_pretrained; "
            "assert weightcache.load_into is t.load_into; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_bench_restart_smoke_on_cpu(tmp_path, capsys):
    """bench/restart.py end to end on the CPU (the H200 run uses the same code with bigger presets)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_restart", ROOT / "bench" / "restart.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--models", "tiny", "--runs", "1", "--device", "cpu", "--ckpt-dir", str(tmp_path / "ck"),
                     "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert rc == 0, capsys.readouterr()
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"transformers", "weightcache"}  # no CUDA IPC without CUDA
    assert rows["weightcache"]["tokens"] == rows["transformers"]["tokens"]
    for r in rows.values():
        assert 0 < r["load_seconds_median"] < r["restart_seconds_median"]
    assert rows["weightcache"]["phase_attach_median"] < rows["weightcache"]["load_seconds_median"]
    assert "| tiny |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").stat().st_size > 0


# ---- GPU (bf16 on CUDA) -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_gpu_bf16_same_tokens_as_transformers(ckpts, sockdir, which):
    ckpt = ckpts[which]
    with serve(ckpt, sockdir, dtype=torch.bfloat16, device="cuda"):
        free0 = torch.cuda.mem_get_info()[0]
        model = wct.from_pretrained(ckpt, device="cuda", dtype=torch.bfloat16, socket_dir=sockdir, fallback=False)
        assert model._weightcache_source == "attach" and model.device.type == "cuda"
        assert model.model.rotary_emb.inv_freq.device.type == "cuda"
        assert free0 - torch.cuda.mem_get_info()[0] < 64 << 20  # mapped, not copied
        ref = reference(ckpt, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(greedy(model), greedy(ref))
        if which == "tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_every_family_is_transformers_own_model(families, sockdir, family):
    """bf16 on the GPU: the daemon's from_pretrained on cuda, mapped zero-copy; every tensor and the logits are
    those of ``from_pretrained(device_map=cuda)``."""
    ckpt = families[family]
    with serve(ckpt, sockdir, device="cuda"):
        free0 = torch.cuda.mem_get_info()[0]
        model = wct.from_pretrained(ckpt, device="cuda", socket_dir=sockdir, fallback=False)
        assert free0 - torch.cuda.mem_get_info()[0] < 64 << 20  # mapped, not copied
        assert model.lm_head.weight.device.type == "cuda"
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map={"": "cuda:0"})
        assert_same_model(model, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_gpu_fp8_block_checkpoint_stays_fp8(fp8, sockdir, family):
    """On an FP8 GPU transformers keeps the checkpoint in FP8 (FP8Linear / FP8Experts with per-block
    ``weight_scale_inv``): the daemon holds exactly those tensors and the engine binds them zero-copy."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    ckpt = fp8[family]
    with serve(ckpt, sockdir, device="cuda"):
        model = wct.from_pretrained(ckpt, device="cuda", socket_dir=sockdir, fallback=False)
        att = model._weightcache_attachment
        q = model.model.layers[0].self_attn.q_proj
        assert type(q).__name__ == "FP8Linear" and q.weight.dtype == torch.float8_e4m3fn
        assert q.weight_scale_inv.dtype == torch.float32 and q.weight_scale_inv.shape == (1, 2)
        assert q.weight_scale_inv.data_ptr() == att["model.layers.0.self_attn.q_proj.weight_scale_inv"].data_ptr()
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map={"": "cuda:0"})
        assert parity(engine_state(ref), engine_state(model)) == []
        assert model.is_quantized and model.config.quantization_config.to_dict() == \
            ref.config.quantization_config.to_dict()
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        try:
            load_finegrained_fp8_kernel()
        except ImportError as e:
            pytest.skip(f"every tensor matches; transformers' FP8 kernel is not available here to run it: {e}")
        assert_same_model(model, ref)


@pytest.mark.gpu
def test_gpu_bench_restart_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "restart.py"), "--models", "tiny", "--runs", "1",
         "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "r.json"), "--no-plot"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["engine"] for r in rows} == {"transformers", "weightcache", "cuda_ipc"}


TP_ENGINE = r"""
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
os.environ["LOCAL_RANK"] = str(rank)
device = "cpu" if {device!r} == "cpu" else f"cuda:{{rank}}"
if device != "cpu":
    torch.cuda.set_device(rank)
dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method="tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
import weightcache.transformers as wct
from weightcache.integrations.model_state import parity, reachable_tensors
from weightcache.integrations.transformers.compat import RULES
ep = {ep!r}
m = wct.from_pretrained({ckpt!r}, device=device, socket_dir={sockdir!r}, fallback=False,
                        layout="dp1-pp1-tp2" + ("-ep2" if ep else ""), rank=rank)
assert m._weightcache_source == "attach"
ref = AutoModelForCausalLM.from_pretrained({ckpt!r}, distributed_config=DistributedConfig(
    tp_size=2, tp_plan="auto", **({{"ep_size": 2}} if ep else {{}})))
diffs = parity(reachable_tensors(ref, RULES)[0], reachable_tensors(m, RULES)[0])
assert diffs == [], diffs
ids = torch.tensor({prompt!r}, device=device)
with torch.no_grad():
    a, b = m(ids).logits, ref(ids).logits
a, b = (x.to_local() if hasattr(x, "to_local") else x for x in (a, b))
assert a.device == torch.device(device)
assert torch.equal(a, b), (a - b).abs().max()
print("OK", rank, type(m.model.layers[0].self_attn.q_proj.weight).__name__, flush=True)
dist.destroy_process_group()
os._exit(0)  # past the checks: gloo's worker threads can abort the interpreter's teardown (seen once under `make test`)
"""


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_tensor_parallel_moe_from_transformers_own_plan(tmp_path, sockdir, ep, device):
    """`preload -tp 2 [-ep]` of a MoE: each daemon runs transformers' own tensor (expert) parallel loading; a
    tensor parallel engine (two processes) binds its rank's shards into transformers' own DTensor model and
    computes the logits a disk load in the same world computes, bit for bit."""
    import socket

    pytest.importorskip("accelerate", reason="transformers' tensor parallel loading needs accelerate")
    ckpt = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_heads=4, num_kv_heads=2)
    log = open(tmp_path / "preload.log", "w+")
    args = ["-ep"] if ep else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(ckpt), "-tp", "2", *args,
         "--device", device, "--weight-cache-socket-dir", sockdir], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = ""
        while "READY" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, (tmp_path / "preload.log").read_text()
        assert "(dp1-pp1-tp2" in line
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        code = TP_ENGINE.format(port=port, ckpt=str(ckpt), sockdir=sockdir, prompt=PROMPT, ep=ep, device=device)
        engines = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outs = [e.communicate(timeout=300)[0] for e in engines]
        for r, (e, out) in enumerate(zip(engines, outs, strict=True)):
            assert e.returncode == 0 and f"OK {r} DTensor" in out, out
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
