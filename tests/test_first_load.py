"""The engines' own loaders fed by weightcache's reader: transformers' from_pretrained reading through a
CheckpointStream builds exactly the model it builds reading the files itself (every tensor, dense, MoE, FP8,
tied weights, sharded checkpoints), and the stream keeps its memory bounded and its contract."""

import threading

import pytest
import torch

from weightcache.integrations.model_state import parity, reachable_tensors
from weightcache.integrations.transformers.compat import RULES
from weightcache.integrations.transformers.producer import build_model
from weightcache.reader.header import read_header
from weightcache.reader.reading import CheckpointError
from weightcache.reader.settings import ReadSettings
from weightcache.reader.stream import CheckpointStream, batches_of
from weightcache.testing.checkpoints import FAMILIES, make_checkpoint, make_llama_checkpoint
from weightcache.testing.quantized import make_compressed_fp8_checkpoint, make_fp8_checkpoint

CUDA = torch.cuda.is_available()


def _state(model) -> dict:
    return {k: v for k, v in reachable_tensors(model, RULES)[0].items() if not v.is_meta}


def _both(ckpt, device="cpu", dtype=torch.float32):
    dev = torch.device(device)
    ref, _ = build_model(ckpt, dtype=dtype, device=dev)
    got = []
    lock = threading.Lock()

    def report(n):
        with lock:
            got.append(n)

    fast, seen = build_model(ckpt, dtype=dtype, device=dev, read=ReadSettings.make(progress=False, threads=2),
                             report=report)
    return ref, fast, seen, sum(got)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_through_the_stream_as_it_reads_itself(tmp_path, family):
    ckpt = make_checkpoint(tmp_path / family, family, dtype=torch.bfloat16)
    ref, fast, seen, read = _both(ckpt, dtype=torch.bfloat16)
    assert parity(_state(ref), _state(fast)) == []
    assert read == sum(e.nbytes for f in ckpt.glob("*.safetensors") for e in read_header(f)[0].values())
    assert seen.reread == 0 and {"construct", "load", "finalize"} <= set(seen.phases)


def test_a_sharded_checkpoint_and_a_cast_read_through_the_stream(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path / "m", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                                 num_kv_heads=2, vocab_size=512, max_shard_bytes=40_000)
    assert len(list(ckpt.glob("*.safetensors"))) > 2
    ref, fast, _, _ = _both(ckpt, dtype=torch.float16)  # the files hold float32: transformers casts
    assert parity(_state(ref), _state(fast)) == []


@pytest.mark.parametrize("make", [make_fp8_checkpoint, make_compressed_fp8_checkpoint])
def test_fp8_checkpoints_read_through_the_stream(tmp_path, make):
    ckpt = make(tmp_path / "q", "qwen3", hidden_size=256, intermediate_size=384)
    ref, fast, _, _ = _both(ckpt, dtype=torch.bfloat16)
    assert parity(_state(ref), _state(fast)) == []


def _stream_ckpt(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path / "s", num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4,
                                 num_kv_heads=2, vocab_size=512)
    entries = read_header(next(ckpt.glob("*.safetensors")))[0]
    return ckpt, entries


def test_the_stream_hands_out_every_tensor_once_in_any_order(tmp_path):
    from safetensors.torch import load_file

    ckpt, entries = _stream_ckpt(tmp_path)
    want = load_file(str(next(ckpt.glob("*.safetensors"))))
    order = sorted(entries)
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=20_000,
                          ahead=1) as s:
        assert len(s.batches) > 4
        last = s.take(order[-1])  # far ahead: the reader goes there
        assert torch.equal(last, want[order[-1]])
        got = dict(s)  # the rest, in order; the early batches were retired: read again one by one
        assert set(got) == set(order) - {order[-1]}
        assert all(torch.equal(got[n], want[n]) for n in got)
        assert s.reread > 0
        with pytest.raises(CheckpointError, match="already taken"):
            s.take(order[0])
        with pytest.raises(CheckpointError, match="not in this stream"):
            s.take("no.such.tensor")


def test_the_stream_reads_at_most_ahead_batches_before_the_consumer(tmp_path):
    ckpt, entries = _stream_ckpt(tmp_path)
    order = sorted(entries)
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=20_000,
                          ahead=2) as s:
        s.take(order[0])
        import time

        time.sleep(0.3)  # let the reader run as far as it may
        assert s._read_to <= s.ahead + 1
        held = sum(t.numel() * t.element_size() for t in s._ready.values())
        assert held <= (s.ahead + 1) * max(20_000, max(e.nbytes for e in entries.values()))


def test_the_stream_says_whether_its_consumer_waited_for_the_reader(tmp_path, monkeypatch):
    """A slow reader shows as the consumer's waiting; a slow consumer leaves the reader ahead (no wait)."""
    import time

    ckpt, entries = _stream_ckpt(tmp_path)
    order = sorted(entries)
    fast_read = CheckpointStream._read

    def slow_read(self, names):
        time.sleep(0.1)
        return fast_read(self, names)

    monkeypatch.setattr(CheckpointStream, "_read", slow_read)
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=20_000,
                          ahead=2) as s:
        batches = len(s.batches)
        dict(s)
    assert s.timings["consumer waited"] >= 0.08 * batches
    assert s.timings["read"] > 0 and s.timings["allocate"] > 0

    began = time.perf_counter()  # consumers on two threads (as transformers loads): their waits count once
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=20_000,
                          ahead=2) as s:
        threads = [threading.Thread(target=lambda part: [s.take(n) for n in part], args=(order[i::2],))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert 0.08 * batches <= s.timings["consumer waited"] <= time.perf_counter() - began

    monkeypatch.setattr(CheckpointStream, "_read", fast_read)
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=20_000,
                          ahead=2) as s:
        for name in order:
            s.take(name)
            time.sleep(0.02)
    assert s.timings["consumer waited"] < 0.01 * len(order)


def test_batches_keep_order_and_a_large_tensor_alone(tmp_path):
    _, entries = _stream_ckpt(tmp_path)
    order = sorted(entries)
    batches = batches_of(order, entries, 20_000)
    assert [n for b in batches for n in b] == order
    for b in batches:
        assert len(b) == 1 or sum(entries[n].nbytes for n in b) <= 20_000


def test_a_truncated_file_is_one_clear_error_in_the_consumer(tmp_path):
    import os

    ckpt, entries = _stream_ckpt(tmp_path)
    f = next(ckpt.glob("*.safetensors"))
    order = sorted(entries, key=lambda n: entries[n].start)
    os.truncate(f, entries[order[-1]].start)
    with CheckpointStream(entries, order, "cpu", ReadSettings.make(progress=False), batch_bytes=1 << 30) as s:
        with pytest.raises(CheckpointError, match="reading the checkpoint failed"):
            s.take(order[0])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_transformers_reads_through_the_stream_on_the_gpu(tmp_path, family):
    ckpt = make_checkpoint(tmp_path / family, family, dtype=torch.bfloat16)
    ref, fast, seen, _ = _both(ckpt, device="cuda", dtype=torch.bfloat16)
    assert parity(_state(ref), _state(fast)) == []
    assert seen.reread == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp8_reads_through_the_stream_on_the_gpu(tmp_path):
    ckpt = make_fp8_checkpoint(tmp_path / "q", "qwen3", hidden_size=256, intermediate_size=384)
    ref, fast, _, _ = _both(ckpt, device="cuda", dtype=torch.bfloat16)
    assert parity(_state(ref), _state(fast)) == []


def test_a_checkpoint_the_reader_cannot_read_is_read_by_transformers_with_one_warning(tmp_path, caplog):
    """A pytorch_model.bin checkpoint: weightcache's reader steps aside in one warning line, transformers reads
    it itself, and the model is the one transformers builds alone."""
    from safetensors.torch import load_file

    ckpt = make_llama_checkpoint(tmp_path / "m", seed=3, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=2, num_kv_heads=1, vocab_size=320)
    weights = ckpt / "model.safetensors"
    torch.save(load_file(weights), ckpt / "pytorch_model.bin")
    weights.unlink()
    with caplog.at_level("WARNING", logger="weightcache"):
        ref, fast, seen, _ = _both(ckpt)
    lines = [r.getMessage() for r in caplog.records if "is not safetensors" in r.getMessage()]
    assert lines == ["pytorch_model.bin is not safetensors: transformers reads this checkpoint itself (slower)"]
    assert parity(_state(ref), _state(fast)) == []
