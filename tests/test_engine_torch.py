"""load_into: binding cached tensors into torch modules built on the meta device."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import weightcache as wc
from conftest import DEVICES
from weightcache.integrations.torch import BindError, init_empty, load_into
from weightcache.key import CacheKey
from weightcache.sockets import socket_name

KEY = CacheKey(model="tiny", content_digest="d1")
ROOT = Path(__file__).resolve().parents[1]


class Rotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        ar = torch.arange(0, self.dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq.copy_(1.0 / (self.base ** (ar / self.dim)))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, dtype=dtype)
        self.rot = Rotary(dim)
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        x = self.emb(ids)
        pos = torch.arange(ids.shape[-1], device=ids.device, dtype=torch.float32)
        ang = pos[:, None] * self.rot.inv_freq[None]
        x = x + torch.cat([ang.sin(), ang.cos()], -1).to(x.dtype)
        return self.head(self.norm(self.proj(x)))


class NoReset(nn.Module):
    """A buffer computed in __init__ only (no reset_parameters)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.linspace(0, 1, 4) ** 2, persistent=False)

    def forward(self, x):
        return self.lin(x) * self.table


class WithAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.ones(3)  # a plain tensor attribute, not a parameter or buffer

    def forward(self, x):
        return self.lin(x) * self.scale


def _ref(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    ref = Tiny(dtype=dtype).to(device)
    ref.rot.reset_parameters()  # computed on the device, as load_into recomputes it
    return ref


def _meta(**kw):
    with torch.device("meta"):
        return Tiny(**kw)


def _sock(d, name="r0.sock"):
    return os.path.join(d, name)


def _ids(device="cpu"):
    return torch.tensor([[1, 5, 7, 3, 9]], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_bind_into_meta_module_matches_reference(sockdir, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = _ref(device, dtype)
    with wc.publish(ref.state_dict(), _sock(sockdir), KEY):
        m = _meta(dtype=dtype)
        att = load_into(m, _sock(sockdir), expect=KEY)
        assert m._weightcache_attachment is att
        assert m.head.weight is m.emb.weight  # tied stays tied: one Parameter
        assert m.emb.weight.data_ptr() == att["emb.weight"].data_ptr()  # zero-copy
        assert m.rot.inv_freq.device.type == torch.device(device).type
        assert torch.equal(m.rot.inv_freq, ref.rot.inv_freq)  # recomputed by reset_parameters on the device
        assert not any(t.is_meta for t in [*m.parameters(), *m.buffers()])
        with torch.no_grad():
            out, want = m(_ids(device)), ref(_ids(device))
        if device == "cpu":
            assert torch.equal(out, want)
        else:  # same bytes; kernels may be picked by pointer alignment
            torch.testing.assert_close(out, want)


def test_tied_weight_stored_once_still_ties(sockdir):
    ref = _ref()
    state = {k: v for k, v in ref.state_dict().items() if k != "head.weight"}  # as save_pretrained writes it
    with wc.publish(state, _sock(sockdir), KEY):
        m = _meta()
        load_into(m, _sock(sockdir))
        assert m.head.weight is m.emb.weight
        with torch.no_grad():
            assert torch.equal(m(_ids()), ref(_ids()))


def test_missing_key_is_refused_and_module_untouched(sockdir):
    state = {k: v for k, v in _ref().state_dict().items() if k != "proj.bias"}
    with wc.publish(state, _sock(sockdir), KEY):
        m = _meta()
        with pytest.raises(BindError, match=r"missing from the cache \(1\):\n\s+proj.bias") as e:
            load_into(m, _sock(sockdir))
        assert e.value.missing == ["proj.bias"]
        assert m.proj.weight.is_meta and m.emb.weight.is_meta  # nothing was bound
        assert "_weightcache_attachment" not in m.__dict__


def test_missing_key_is_refused_even_when_not_strict(sockdir):
    state = {k: v for k, v in _ref().state_dict().items() if k != "proj.bias"}
    with wc.publish(state, _sock(sockdir), KEY):
        with pytest.raises(BindError, match="proj.bias"):
            load_into(_meta(), _sock(sockdir), strict=False)  # would leave a meta tensor


def test_wrong_dtype_and_shape_are_refused(sockdir):
    state = dict(_ref().state_dict())
    state["proj.weight"] = state["proj.weight"].double()
    state["norm.bias"] = torch.zeros(17)
    with wc.publish(state, _sock(sockdir), KEY):
        with pytest.raises(BindError) as e:
            load_into(_meta(), _sock(sockdir))
    msg = str(e.value)
    assert "proj.weight: float32[16, 16] vs float64[16, 16]" in msg
    assert "norm.bias: float32[16] vs float32[17]" in msg
    assert {n for n, _, _ in e.value.mismatched} == {"proj.weight", "norm.bias"}


def test_unexpected_key_strict_and_not_strict(sockdir):
    state = dict(_ref().state_dict())
    state["extra.weight"] = torch.zeros(2)
    with wc.publish(state, _sock(sockdir), KEY):
        with pytest.raises(BindError, match=r"unexpected .*\n\s+extra.weight") as e:
            load_into(_meta(), _sock(sockdir))
        assert e.value.unexpected == ["extra.weight"]
        m = _meta()
        load_into(m, _sock(sockdir), strict=False)
        assert not m.proj.weight.is_meta
        load_into(_meta(), _sock(sockdir), ignore_unexpected=[r"^extra\."])


def test_tied_in_module_but_different_in_cache(sockdir):
    state = dict(_ref().state_dict())
    state["head.weight"] = state["emb.weight"] + 1.0
    with wc.publish(state, _sock(sockdir), KEY):
        with pytest.raises(BindError, match="tied in the module but different in the cache"):
            load_into(_meta(), _sock(sockdir))
        m = _meta()
        load_into(m, _sock(sockdir), untie_conflicting=True)
        assert m.head.weight is not m.emb.weight
        assert torch.equal(m.head.weight, state["head.weight"])


def _all_meta(cls):
    """Every parameter and buffer on meta. (Not `with torch.device("meta")`: once transformers has loaded a
    model in this process, torch.linspace under that context no longer lands on meta.)"""
    return cls().to("meta")


def test_nonpersistent_buffer_without_reset_needs_init_empty_or_cache(sockdir):
    torch.manual_seed(0)
    ref = NoReset()
    with wc.publish(ref.state_dict(), _sock(sockdir), KEY):
        m = _all_meta(NoReset)
        with pytest.raises(BindError, match="table.*|init_empty"):
            load_into(m, _sock(sockdir))
        assert m.lin.weight.is_meta
        with init_empty():
            m = NoReset()
        assert m.lin.weight.is_meta and not m.table.is_meta  # buffers computed by __init__
        load_into(m, _sock(sockdir))
        x = torch.randn(2, 4)
        assert torch.equal(m(x), ref(x))
    # the cache can carry the buffer itself
    state = dict(ref.state_dict(), table=torch.full((4,), 3.0))
    with wc.publish(state, _sock(sockdir), KEY, roles={"table": "nonpersistent_buffer"}):
        m = _all_meta(NoReset)
        load_into(m, _sock(sockdir))
        assert torch.equal(m.table, torch.full((4,), 3.0))


class LazyReset(NoReset):
    def reset_parameters(self):  # forgets the buffer
        pass


def test_buffer_an_initialiser_does_not_fill_is_caught(sockdir):
    torch.manual_seed(0)
    with wc.publish(NoReset().state_dict(), _sock(sockdir), KEY):
        m = _all_meta(LazyReset)
        with pytest.raises(BindError, match="table was not recomputed by LazyReset"):
            load_into(m, _sock(sockdir))

        def init_table(root, owner_name, owner):
            owner.table.copy_(torch.arange(4.0))

        m = _all_meta(LazyReset)
        load_into(m, _sock(sockdir), init_buffers=init_table)
        assert torch.equal(m.table, torch.arange(4.0))


def test_init_empty_restores_torch():
    init_fn, reg = nn.init.normal_, nn.Module.register_parameter
    with init_empty():
        lin = nn.Linear(2, 2)
    assert lin.weight.is_meta
    assert nn.init.normal_ is init_fn and nn.Module.register_parameter is reg
    assert not nn.Linear(2, 2).weight.is_meta


def test_tensor_attribute_role(sockdir):
    torch.manual_seed(0)
    ref = WithAttr()
    ref.scale = torch.tensor([0.5, 2.0, 3.0])
    state = dict(ref.state_dict(), scale=ref.scale)
    with wc.publish(state, _sock(sockdir), KEY, roles={"scale": "attribute"}):
        with torch.device("meta"):
            m = WithAttr()
        load_into(m, _sock(sockdir))
        x = torch.randn(2, 3)
        assert torch.equal(m(x), ref(x))
    with wc.publish(ref.state_dict(), _sock(sockdir), KEY):
        with torch.device("meta"):
            m = WithAttr()
        with pytest.raises(BindError, match=r"left on the meta device.*\n\s+scale"):
            load_into(m, _sock(sockdir))  # never silently a meta tensor


def test_socket_directory_sources(sockdir):
    ref = _ref()
    other = CacheKey(model="other", content_digest="d2")
    with wc.publish(ref.state_dict(), _sock(sockdir, socket_name(KEY, "cpu")), KEY):
        m = _meta()
        load_into(m, sockdir)  # the only daemon in the directory
        with wc.publish({"x": torch.zeros(1)}, _sock(sockdir, socket_name(other, "cpu")), other):
            with pytest.raises(wc.WeightCacheError, match="2 daemons"):
                load_into(_meta(), sockdir)
            for device in ("cpu", None):  # by name for the device, or by the key's hash alone
                m = _meta()
                load_into(m, sockdir, expect=KEY, device=device)
                assert torch.equal(m.proj.weight, ref.proj.weight)
            with pytest.raises(wc.KeyMismatch, match="model"):
                load_into(_meta(), _sock(sockdir, socket_name(other, "cpu")), expect=KEY)


def test_bad_sources(tmp_path):
    with pytest.raises(TypeError, match="socket path"):
        load_into(_meta(), 42)
    with pytest.raises(wc.DaemonUnavailable, match="no such socket"):
        load_into(_meta(), tmp_path / "nope.sock")
    with pytest.raises(wc.DaemonUnavailable, match="no weight cache daemon socket"):
        load_into(_meta(), tmp_path)
    with pytest.raises(TypeError, match="nn.Module"):
        from weightcache.integrations.torch import bind

        bind(object(), {})


def test_weights_outlive_daemon_and_attachment_object(sockdir):
    ref = _ref()
    d = wc.publish(ref.state_dict(), _sock(sockdir), KEY)
    m = _meta()
    load_into(m, _sock(sockdir))
    d.close()
    assert not os.path.exists(_sock(sockdir))
    with torch.no_grad():
        assert torch.equal(m(_ids()), ref(_ids()))


def test_attachment_object_as_source_and_copy_mode(sockdir):
    ref = _ref()
    with wc.publish(ref.state_dict(), _sock(sockdir), KEY):
        with wc.attach(_sock(sockdir), mode="copy") as att:
            m = _meta()
            assert load_into(m, att) is att
            with torch.no_grad():
                m.proj.weight.add_(1.0)  # private, writable
        with wc.attach(_sock(sockdir)) as shared:
            assert torch.equal(shared["proj.weight"], ref.proj.weight)
        att = wc.attach(_sock(sockdir))
        att.close()
        with pytest.raises(wc.WeightCacheError, match="closed"):
            load_into(_meta(), att)


def test_trainer_publish_example(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_publish", ROOT / "examples" / "trainer_publish.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rc = example.main(["--versions", "2", "--steps-per-version", "2", "--socket-dir", str(tmp_path / "s")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "inference: attached v2" in out
    assert "old version v1 still correct after its daemon closed" in out
    assert out.count("outputs match") == 2 and "DIFFER" not in out and "WRONG" not in out
