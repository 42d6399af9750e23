"""What a daemon's CUDA load does on its main thread before the copy loop starts, phase by phase, on the CPU (no
GPU, no weights: the checkpoint is a sparse file with real headers, the destinations are meta tensors).

Phases, in the order a daemon runs them: the source (headers, the TP plan), the manifest (the arena's layout),
the views over the arena, the views checked against the source, the reads planned (pieces), the files mapped
(``CudaFill`` picks each file's way), and the native loop's plan (the loop packs it into windows itself). The
segments row is what the other staged paths (torch's window pipeline, the workers) plan instead of the
native loop's plan.

    python bench/setup_cost.py --size-gb 16 --runs 30          # -> bench/results/setup-cost-<host>.json
    python bench/setup_cost.py --size-gb 16 --tp 2 --runs 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from weightcache.manifest import plan_for_metas  # noqa: E402
from weightcache.packing import build_views  # noqa: E402
from weightcache.reader import cuda_fill  # noqa: E402
from weightcache.reader.read_plan import Segment  # noqa: E402
from weightcache.sources.safetensors import SafetensorsSource  # noqa: E402
from weightcache.testing.checkpoints import llama_config_for_bytes, llama_param_shapes  # noqa: E402

PHASES = ("source", "manifest", "views", "check views", "plan reads", "map files", "native plan", "segments")
ON_PATH = PHASES[:-1]  # what the default (the native loop) runs


def sparse_checkpoint(root: Path, size_gb: float, shard_gb: float) -> Path:
    """A Llama-shaped bf16 checkpoint of ``size_gb`` whose files hold real headers and holes for data."""
    kw = llama_config_for_bytes(int(size_gb * 1e9))
    path = root / f"llama-{size_gb:g}gb-sparse"
    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "hidden_size": kw["hidden_size"],
                                                  "intermediate_size": kw["intermediate_size"],
                                                  "num_attention_heads": kw["num_heads"],
                                                  "num_key_value_heads": kw["num_kv_heads"],
                                                  "num_hidden_layers": kw["num_layers"],
                                                  "vocab_size": kw["vocab_size"]}))
    shards, cur, size = [], [], 0
    for name, shape in llama_param_shapes(**kw).items():
        n = math.prod(shape) * 2
        if cur and size + n > shard_gb * 1e9:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, n))
        size += n
    shards.append(cur)
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape, n in group:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            weight_map[name] = fname
            off += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / ".complete").touch()
    return path


def one_run(path: Path, tp: int) -> tuple[dict[str, float], dict]:
    t, marks = {}, [time.perf_counter()]

    def mark(name: str) -> None:
        marks.append(time.perf_counter())
        t[name] = marks[-1] - marks[-2]

    src = SafetensorsSource(path, tp_rank=0, tp_size=tp, io="staged", progress=False)
    mark("source")
    manifest = plan_for_metas(src.describe())
    mark("manifest")
    arena = torch.empty(sum(b.nbytes for b in manifest.blocks), dtype=torch.uint8, device="meta")
    views = build_views(manifest, [arena[: b.nbytes] for b in manifest.blocks])
    mark("views")
    src.device = torch.device("meta")  # the views' device
    src._check_views(views)
    mark("check views")
    read_plan = src.read_plan(views)
    pieces = read_plan.pieces
    mark("plan reads")
    fill = cuda_fill.CudaFill(read_plan, src.read, views, lambda n: None, device=torch.device("cuda", 0))
    fill.index = 0
    fill._choose_modes()
    mark("map files")
    piped = {f for f in fill.maps if fill._pipelined(f)}
    read_plan.work_items(fill._segment_bytes, src.read.order, [p for p in pieces if p.file not in piped])
    plan, _ = fill._native_plan([p for p in pieces if p.file in piped])
    mark("native plan")
    items = read_plan.work_items(fill._segment_bytes, src.read.order)
    fill._window_loads([i for i in items if isinstance(i, Segment) and i.file in piped])
    mark("segments")
    for fm in fill.maps.values():
        fm.close()
    return t, {"tensors": len(src.tensors), "pieces": len(plan), "slices": len(read_plan.slices),
               "segments": sum(isinstance(i, Segment) for i in items), "files": len(fill.maps), "bytes": src.nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/wcsetup", help="where the sparse checkpoint goes")
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--shard-gb", type=float, default=4.5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    path = sparse_checkpoint(Path(args.dir), args.size_gb, args.shard_gb)
    first, _ = one_run(path, args.tp)  # the first in the process, as a daemon's one load: lazy imports, cold caches
    for _ in range(2):
        one_run(path, args.tp)
    runs, shape = [], {}
    for _ in range(args.runs):
        r, shape = one_run(path, args.tp)
        runs.append(r)
    rows = {p: {"median_ms": round(statistics.median(r[p] for r in runs) * 1e3, 3),
                "min_ms": round(min(r[p] for r in runs) * 1e3, 3), "first_ms": round(first[p] * 1e3, 3)}
            for p in PHASES}
    on_path = [sum(r[p] for p in ON_PATH) for r in runs]
    print(f"{shape['tensors']} tensors, {shape['pieces']} pieces, {shape['segments']} segments, "
          f"{shape['files']} files, {shape['bytes'] / 1e9:.1f} GB, TP rank 0 of {args.tp}, {os.cpu_count()} CPUs")
    print(f"{'phase':<14} {'median ms':>10} {'min ms':>8} {'first ms':>9}")
    for p, v in rows.items():
        print(f"{p:<14} {v['median_ms']:>10.3f} {v['min_ms']:>8.3f} {v['first_ms']:>9.3f}"
              f"{'' if p in ON_PATH else '  (not on the default path)'}")
    first_on_path = sum(first[p] for p in ON_PATH)
    print(f"{'on the path':<14} {statistics.median(on_path) * 1e3:>10.3f} {min(on_path) * 1e3:>8.3f} "
          f"{first_on_path * 1e3:>9.3f}")
    host = socket.gethostname().split(".")[0]
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"setup-cost-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": host, "cpus": os.cpu_count(), "size_gb": args.size_gb, "tp": args.tp,
                               "runs": args.runs, "shape": shape, "phases": rows,
                               "on_path_median_ms": round(statistics.median(on_path) * 1e3, 3),
                               "on_path_first_ms": round(first_on_path * 1e3, 3),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
