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
from transformers import AutoModelForCausalLM

import weightcache as wc
import weightcache.transformers as wct
from weightcache.checkpoints import make_llama_checkpoint
from weightcache.daemon import Daemon
from weightcache.engines.torch import BindError
from weightcache.key import checkpoint_digest, config_digest, dtype_name
from weightcache.naming import device_tag, socket_path
from weightcache.sources.safetensors import SafetensorsSource

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


def serve(ckpt, sockdir, *, dtype=None, device="cpu", tensors=None, key=None) -> Daemon:
    """A daemon holding the checkpoint as preload does for engine "transformers"."""
    key = key or wct.key_for_checkpoint(ckpt, dtype=dtype)
    d = Daemon(socket_path(sockdir, key, device_tag(device)), key, device=device)
    d.start()
    if tensors is None:
        d.load(SafetensorsSource(ckpt, dtype=wct.resolve_dtype(ckpt, dtype), device=device, progress=False))
    else:
        d.load_tensors(tensors)
    return d


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
        assert type(model) is type(ref) and not model.training
        assert model.generation_config.to_dict() == ref.generation_config.to_dict()
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


def test_rotary_recomputed_where_init_weights_has_no_rule_for_it(ckpts, sockdir, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    ckpt = ckpts["untied"]
    ref = reference(ckpt)
    orig = LlamaPreTrainedModel._init_weights

    def without_rotary(self, module):
        if "RotaryEmbedding" not in type(module).__name__:
            orig(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", without_rotary)
    with serve(ckpt, sockdir):
        model = wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir, fallback=False)
        for name in ("inv_freq", "original_inv_freq"):
            assert torch.equal(getattr(model.model.rotary_emb, name), getattr(ref.model.rotary_emb, name)), name
        assert torch.equal(greedy(model), greedy(ref))


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


def _load(ckpt):
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model.safetensors"))


def test_missing_tensor_in_the_cache_is_a_clear_error(ckpts, sockdir):
    ckpt = ckpts["untied"]
    tensors = {k: v for k, v in _load(ckpt).items() if k != "model.layers.1.mlp.down_proj.weight"}
    with serve(ckpt, sockdir, tensors=tensors):
        with pytest.raises(BindError, match=r"missing from the cache \(1\):\n\s+model.layers.1.mlp.down_proj.weight"):
            wct.from_pretrained(ckpt, device="cpu", socket_dir=sockdir)  # not hidden by the fallback


def test_wrong_dtype_in_the_cache_is_a_clear_error(ckpts, sockdir):
    ckpt = ckpts["untied"]
    tensors = dict(_load(ckpt))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].half()
    with serve(ckpt, sockdir, tensors=tensors):
        with pytest.raises(BindError, match=r"model.norm.weight: float32\[64\] vs float16\[64\]"):
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


def test_quantized_checkpoint_is_refused_on_the_attach_path(ckpts, tmp_path, sockdir):
    q = tmp_path / "q"
    q.mkdir()
    cfg = json.loads((Path(ckpts["untied"]) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (q / "config.json").write_text(json.dumps(cfg))
    (q / "model.safetensors").symlink_to(Path(ckpts["untied"]) / "model.safetensors")
    with pytest.raises(wc.WeightCacheError, match="quantized"):
        wct.from_pretrained(q, device="cpu", socket_dir=sockdir, fallback=False)


def test_bad_arguments(ckpts, sockdir, tmp_path):
    with pytest.raises(ValueError, match="mode"):
        wct.from_pretrained(ckpts["untied"], mode="mmap", socket_dir=sockdir)
    with pytest.raises(FileNotFoundError):
        wct.from_pretrained(tmp_path / "missing", socket_dir=sockdir)
    with pytest.raises(TypeError, match="dtype"):
        wct.from_pretrained(ckpts["untied"], dtype=3, socket_dir=sockdir)
    with pytest.raises(wc.WeightCacheError, match="layout dp1-pp1-tp2: from_pretrained binds whole models"):
        wct.from_pretrained(ckpts["untied"], layout="dp1-pp1-tp2", rank=1, socket_dir=sockdir)


def test_module_attribute_access():
    code = ("import sys, weightcache; assert 'transformers' not in sys.modules; "
            "from weightcache.engines import transformers as e, torch as t; "
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
def test_gpu_bench_restart_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "restart.py"), "--models", "tiny", "--runs", "1",
         "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "r.json"), "--no-plot"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["engine"] for r in rows} == {"transformers", "weightcache", "cuda_ipc"}
