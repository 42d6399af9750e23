import pytest
import torch

from procs import bits, sample_tensors
from weightcache.manifest import (
    BlockSpec,
    Manifest,
    StorageSpec,
    TensorMeta,
    TensorSpec,
    plan_for_metas,
    validate,
)
from weightcache.packing import build_views, plan_for_tensors, storage_bytes


def pack(tensors, block_bytes=1 << 20):
    manifest, spans = plan_for_tensors(tensors, block_bytes=block_bytes)
    validate(manifest)
    blocks = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in manifest.blocks]
    for spec, (t, start, end) in zip(manifest.storages, spans, strict=True):
        blocks[spec.block][spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
    return manifest, build_views(manifest, blocks)


def test_round_trip_keeps_bits_shapes_strides_and_dtypes():
    src = sample_tensors()
    _, views = pack(src)
    for name, t in src.items():
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape and v.stride() == t.stride(), name
        assert torch.equal(bits(v), bits(t)), name


def test_shared_storage_packed_once_and_stays_shared():
    src = sample_tensors()
    manifest, views = pack(src)
    assert views["embed"].data_ptr() == views["lm_head"].data_ptr()
    specs = {t.name: t for t in manifest.tensors}
    assert specs["slice_a"].storage == specs["slice_b"].storage
    # writing through one view is seen by the other, as in the original storage
    views["slice_a"][5, 0] = 42.0
    assert views["slice_b"].untyped_storage().data_ptr() == views["slice_a"].untyped_storage().data_ptr()
    distinct = {id(t.untyped_storage()) for t in src.values()}
    assert len(manifest.storages) <= len(distinct)


def test_small_blocks_split_and_big_storage_gets_own_block():
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(10)}  # 1 KiB each
    tensors["big"] = torch.arange(4096, dtype=torch.float32)  # 16 KiB > block
    manifest, views = pack(tensors, block_bytes=4096)
    assert len(manifest.blocks) >= 4
    assert max(b.nbytes for b in manifest.blocks) >= 16384
    for name, t in tensors.items():
        assert torch.equal(views[name], t)


def test_offsets_are_aligned():
    metas = [TensorMeta(f"w{i}", "bfloat16", [i + 1, 3]) for i in range(20)]
    manifest = plan_for_metas(metas, block_bytes=1 << 16)
    assert all(s.offset % 256 == 0 for s in manifest.storages)
    validate(manifest)


@pytest.mark.parametrize(
    "bad",
    [
        Manifest([TensorSpec("a", "float32", [4], [1], 0, 0)], [StorageSpec(0, 0, 8)], [BlockSpec(256)]),
        Manifest([TensorSpec("a", "float32", [4], [1], 1, 0)], [StorageSpec(0, 0, 16)], [BlockSpec(256)]),
        Manifest([TensorSpec("a", "float32", [4], [1], 0, 0)], [StorageSpec(0, 250, 16)], [BlockSpec(256)]),
        Manifest([TensorSpec("a", "float32", [4], [1], 0, 2)], [StorageSpec(0, 0, 32)], [BlockSpec(256)]),
        Manifest([TensorSpec("a", "float32", [2], [1], 0, 0)] * 2, [StorageSpec(0, 0, 16)], [BlockSpec(256)]),
        Manifest([TensorSpec("a", "float32", [2], [1], 0, 0)], [StorageSpec(0, 2, 16)], [BlockSpec(256)]),
    ],
    ids=["past-storage", "no-storage", "past-block", "misaligned", "duplicate", "misaligned-storage"],
)
def test_validate_refuses_wild_specs(bad):
    with pytest.raises(ValueError):
        validate(bad)


def test_meta_and_sparse_tensors_are_refused():
    with pytest.raises(ValueError, match="meta"):
        plan_for_tensors({"m": torch.empty(3, device="meta")})
    with pytest.raises(ValueError, match="strided"):
        plan_for_tensors({"s": torch.eye(3).to_sparse()})
    with pytest.raises(ValueError, match="duplicate"):
        plan_for_metas([TensorMeta("a", "float32", [1]), TensorMeta("a", "float32", [1])])


def _views_one_by_one(manifest, blocks):
    """The plain reference: one as_strided per tensor."""
    out = {}
    for t in manifest.tensors:
        s = manifest.storages[t.storage]
        dtype = getattr(torch, t.dtype)
        block = blocks[s.block]
        flat = block[:block.numel() - block.numel() % dtype.itemsize].view(dtype)
        out[t.name] = flat.as_strided(t.shape, t.stride, (s.offset + t.byte_offset) // dtype.itemsize)
    return out


def test_grouped_views_match_one_view_per_tensor():
    layers = {}
    for i in range(6):  # repeated layers: evenly spaced tensors of one form
        layers[f"l{i}.w"] = torch.randn(8, 16)
        layers[f"l{i}.b"] = torch.randn(16, dtype=torch.bfloat16)
        layers[f"l{i}.wt"] = torch.randn(16, 8).t()  # non-contiguous
    layers["l3.extra"] = torch.randn(8, 16)  # breaks the spacing of l*.w
    layers["empty"] = torch.empty(0, 16)
    layers["empty2"] = torch.empty(0, 16)
    base = torch.randn(64)
    layers["alias_a"] = base[:32].view(4, 8)  # same storage and form, offsets 0 and 0 (an alias), then 32
    layers["alias_b"] = base[:32].view(4, 8)
    layers["alias_c"] = base[32:].view(4, 8)
    manifest, views = pack(layers, block_bytes=4096)
    blocks = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in manifest.blocks]
    grouped, plain = build_views(manifest, blocks), _views_one_by_one(manifest, blocks)
    assert list(grouped) == [t.name for t in manifest.tensors]
    for name, ref in plain.items():
        got = grouped[name]
        assert (got.dtype, got.shape, got.stride(), got.data_ptr()) == (ref.dtype, ref.shape, ref.stride(),
                                                                         ref.data_ptr()), name
    for name, t in layers.items():
        assert torch.equal(bits(views[name]), bits(t)), name
    assert views["alias_a"].data_ptr() == views["alias_b"].data_ptr()


def test_repeated_forms_are_still_bounds_checked_one_by_one():
    spec = [TensorSpec("a", "float32", [4], [1], 0, 0), TensorSpec("b", "float32", [4], [1], 1, 8)]
    bad = Manifest(spec, [StorageSpec(0, 0, 16), StorageSpec(0, 256, 16)], [BlockSpec(512)])
    with pytest.raises(ValueError, match="b: extends past"):
        validate(bad)
    with pytest.raises(ValueError, match="bad shape"):
        validate(Manifest([TensorSpec("a", "float32", [-4], [1], 0, 0)], [StorageSpec(0, 0, 16)],
                          [BlockSpec(256)]))
