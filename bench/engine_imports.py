"""What a vLLM engine imports after the warm interpreter's imports, and what importing it ahead costs.

  discover: import the warm interpreter's defaults, start vLLM's engine in this process on MODEL and generate
            one token; the modules it imported beyond the defaults, in import order, go to --out.
  time:     import the defaults, then each discovered module (fresh process); per-module seconds, whether
            torch's CUDA state was touched, and whether a forked child can still use CUDA.

  python bench/engine_imports.py discover --model DIR --out engine-imports.json
  python bench/engine_imports.py time --list engine-imports.json --out engine-imports-time.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time


def _defaults() -> list[str]:
    from weightcache.warm.main import DEFAULT_IMPORTS

    return list(DEFAULT_IMPORTS)


def _import_defaults() -> float:
    t = time.perf_counter()
    for name in _defaults():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - as the warm interpreter does
            print(f"default {name}: {type(e).__name__}: {e}", file=sys.stderr)
    return time.perf_counter() - t


def discover(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    seconds = _import_defaults()
    before = set(sys.modules)
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=512, gpu_memory_utilization=args.gpu_util, dtype="bfloat16",
              enforce_eager=args.eager)
    llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))
    engine_s = time.perf_counter() - t
    new = [m for m in sys.modules if m not in before]
    return {"defaults": _defaults(), "defaults_seconds": seconds, "engine_seconds": engine_s, "modules": new}


def _fork_can_use_cuda() -> bool:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            code = 0 if float(torch.ones(2, device="cuda").sum()) == 2.0 else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def time_imports(args) -> dict:
    listed = json.load(open(args.list))["modules"]
    seconds = _import_defaults()
    import torch

    rows, failed, touched = [], {}, []
    t0 = time.perf_counter()
    for name in listed:
        if name in sys.modules:
            continue
        t = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - recorded
            failed[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        dt = time.perf_counter() - t
        rows.append((name, dt))
        if torch.cuda.is_initialized() and not touched:
            touched.append(name)
    total = time.perf_counter() - t0
    rows.sort(key=lambda r: -r[1])
    print(f"defaults {seconds:.2f} s; the engine's further imports {total:.2f} s "
          f"({len(rows)} imported, {len(failed)} failed)")
    for name, dt in rows[:25]:
        print(f"  {dt:7.3f} s  {name}")
    fork_ok = _fork_can_use_cuda()
    print(f"torch CUDA initialized by: {touched or 'none'}; a forked child can use CUDA: {fork_ok}")
    return {"defaults_seconds": seconds, "further_seconds": total, "top": rows[:60], "failed": failed,
            "cuda_initialized_by": touched, "forked_child_uses_cuda": fork_ok}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("discover", "time"))
    p.add_argument("--model")
    p.add_argument("--list")
    p.add_argument("--gpu-util", type=float, default=0.3)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = discover(args) if args.mode == "discover" else time_imports(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.mode == "discover":
        print(f"defaults {result['defaults_seconds']:.2f} s, engine {result['engine_seconds']:.2f} s, "
              f"{len(result['modules'])} further modules -> {args.out}")


if __name__ == "__main__":
    main()
