"""Safetensors headers the reader refuses, each in one line naming the file and the tensors."""

from __future__ import annotations

import json
import struct

import pytest

from weightcache.reader.header import checkpoint_entries, read_header
from weightcache.reader.reading import CheckpointError


def write(path, header: dict, data_bytes: int) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def test_a_negative_dimension_is_refused(tmp_path):
    f = tmp_path / "model.safetensors"
    write(f, {"w": f32([-2, -2], 0, 16)}, 16)  # -2 x -2 "needs" 16 bytes: the size check alone passes it
    with pytest.raises(CheckpointError, match=r"tensor 'w' has a negative dimension in its shape \[-2, -2\]"):
        read_header(f)
    write(f, {"w": f32([-1, 0], 0, 0)}, 0)
    with pytest.raises(CheckpointError, match="negative dimension"):
        checkpoint_entries(tmp_path)


@pytest.mark.parametrize("b_range", [(8, 24), (0, 16), (4, 8)])
def test_overlapping_tensors_are_refused_naming_both(tmp_path, b_range):
    f = tmp_path / "model.safetensors"
    n = (b_range[1] - b_range[0]) // 4
    write(f, {"a": f32([4], 0, 16), "b": f32([n], *b_range)}, 24)
    with pytest.raises(CheckpointError) as e:
        read_header(f)
    msg = str(e.value)
    assert "'a'" in msg and "'b'" in msg and "overlap" in msg and str(f) in msg and "\n" not in msg


def test_overlap_after_a_gap_and_far_apart(tmp_path):
    f = tmp_path / "model.safetensors"
    # c lies inside a (which spans 0..64), after b: sorted by start, c must be checked against a, not b
    write(f, {"a": f32([16], 0, 64), "b": f32([1], 8, 12), "c": f32([1], 40, 44)}, 64)
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(f)


def test_adjacent_and_empty_tensors_are_fine(tmp_path):
    f = tmp_path / "model.safetensors"
    write(f, {"a": f32([4], 0, 16), "e": f32([0, 3], 16, 16), "b": f32([2], 16, 24)}, 24)
    entries, _ = read_header(f)
    assert sorted(entries) == ["a", "b", "e"] and entries["b"].start - entries["a"].start == 16
