"""The transformers engine's weight phase on a large-shaped model, without its weights (CPU is enough).

A daemon (in this process) holds stand-ins for every tensor a large model's forward reads: each a
zero-stride view of one element, with the real name, shape, dtype and role, plus the side data a real
capture carries. Fresh engine processes then run ``weightcache.transformers.from_pretrained`` against it
and report its phases: key (identity of the checkpoint), attach (import the arena, one view per tensor),
skeleton (transformers' from_pretrained up to the model built on the meta device), bind (the daemon's
tensors and Python state into it) and rest (transformers' steps after loading: generation config,
quantizer post-processing), plus the import of the model's modeling module, which every engine pays.

    python bench/skeleton.py --models 32b 30b-a3b --runs 5     # -> bench/results/skeleton-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from child_env import with_src_on_path  # noqa: E402

SHAPES = {  # config.json contents (the architectures' own names)
    "32b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
            "num_hidden_layers": 64, "intermediate_size": 27648, "num_attention_heads": 40,
            "num_key_value_heads": 8, "vocab_size": 152064, "dtype": "bfloat16"},
    "8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "dtype": "bfloat16"},
    "30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                "num_hidden_layers": 48, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "vocab_size": 151936, "dtype": "bfloat16"},
}


def write_checkpoint_dir(path: Path, config: dict) -> None:
    """config.json plus an empty weight file (the engine never reads weights; transformers wants one)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    header = b'{"__metadata__":{"format":"pt"}}'
    header += b" " * (-len(header) % 8)
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def stand_ins(model_dir: Path):
    """(tensors, roles) standing in for what the daemon captures, built from the model's meta skeleton."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightcache.integrations import model_state
    from weightcache.integrations.transformers.compat import META_FORMAT, META_NAME, RULES

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    everything, roles = model_state.reachable_tensors(model, RULES)
    tensors, out_roles, canonical = {}, {}, {}
    aliases = {}
    for name, t in everything.items():
        if id(t) in canonical:
            aliases[name] = canonical[id(t)]
            continue
        canonical[id(t)] = name
        tensors[name] = torch.zeros((), dtype=t.dtype).expand(t.shape)  # right shape and dtype, one element
        out_roles[name] = roles[name]
    scalars = {f"{n}._is_hf_initialized" if n else "_is_hf_initialized": {"v": True}
               for n, _ in model.named_modules()}
    meta = {"format": META_FORMAT, "aliases": aliases, "scalars": scalars, "deleted": [], "weight_conversions": [],
            "frozen": [], "dtensors": []}
    tensors[META_NAME] = model_state.side_data_tensor(meta, torch.device("cpu"))
    out_roles[META_NAME] = "attribute"
    return tensors, out_roles


ENGINE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers, weightcache.transformers as wct
from transformers import AutoModelForCausalLM
t_imported = time.perf_counter()
import importlib
cfg = json.load(open({model!r} + "/config.json"))
importlib.import_module(f"transformers.models.{{cfg['model_type']}}.modeling_{{cfg['model_type']}}")
t_modeling = time.perf_counter()
m = wct.from_pretrained({model!r}, device="cpu", socket_dir={sockdir!r}, fallback=False)
t_done = time.perf_counter()
print(json.dumps({{"imports": t_imported - t0, "modeling_import": t_modeling - t_imported,
                  "weight_phase": t_done - t_modeling, **m._weightcache_timings}}))
"""


def run(name: str, runs: int, work: Path) -> dict:
    import torch  # noqa: F401

    import weightcache.transformers as wct
    from weightcache.daemon import Daemon
    from weightcache.sockets import device_tag, socket_path

    model_dir = work / name
    write_checkpoint_dir(model_dir, SHAPES[name])
    tensors, roles = stand_ins(model_dir)
    key = wct.key_for_checkpoint(model_dir, device="cpu")
    sockdir = tempfile.mkdtemp(prefix="wcs", dir="/tmp")
    os.chmod(sockdir, 0o700)
    with Daemon(socket_path(sockdir, key, device_tag("cpu")), key) as d:
        d.start()
        d.load_tensors(tensors, roles)
        rows = []
        for i in range(runs):
            out = subprocess.run([sys.executable, "-c", ENGINE.format(model=str(model_dir), sockdir=sockdir)],
                                 capture_output=True, text=True, env=with_src_on_path())
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"[{name}] run {i + 1}/{runs}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r.items()),
                  flush=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["weight_phase_without_rest"] = summary["key"] + summary["attach"] + summary["skeleton"] + summary["bind"]
    return {"model": name, "tensors": len(tensors) - 1, "runs": rows, "median": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["32b", "30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "skeleton-cpu.json"))
    a = p.parse_args(argv)
    import torch
    import transformers

    result = {"meta": {"host": platform.node(), "cpu": platform.processor(), "cores": os.cpu_count(),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "date": time.strftime("%Y-%m-%d"),
                       "command": "python bench/skeleton.py " + " ".join(argv if argv is not None else sys.argv[1:])},
              "rows": []}
    with tempfile.TemporaryDirectory(prefix="wcsk") as work:
        os.environ.setdefault("XDG_CACHE_HOME", str(Path(work) / ".cache"))
        for name in a.models:
            row = run(name, a.runs, Path(work))
            result["rows"].append(row)
            med = row["median"]
            print(f"[{name}] median: key {med['key'] * 1e3:.0f} ms, attach {med['attach'] * 1e3:.0f} ms, skeleton "
                  f"{med['skeleton'] * 1e3:.0f} ms, bind {med['bind'] * 1e3:.0f} ms, rest {med['rest'] * 1e3:.0f} "
                  f"ms; modeling import {med['modeling_import'] * 1e3:.0f} ms ({row['tensors']} tensors)", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
