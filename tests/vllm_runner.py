"""Run one vLLM engine (in its own process) for the vLLM tests; prints ``RESULT <json>`` or ``ERROR <json>``.

``python tests/vllm_runner.py '<json spec>'``; spec keys: model, dtype, tp, load_format, extra,
speculative_config, prompts, max_tokens, watch (directories whose files' opens are recorded with inotify),
dump (torch.save the engine's state there, see ``engine_state``), reload (kwargs for vLLM's
``reload_weights``, then generate again), external_memory (call the loader's hook), gpu_memory_utilization,
quantization, enforce_eager (default true), max_model_len, ep (expert parallel), kv_cache_memory_bytes (a fixed KV
cache: vLLM skips its memory profiling, so engines can share a GPU). The result also has the KV cache's blocks.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import traceback

IN_ACCESS, IN_OPEN = 0x1, 0x20
PROMPTS = ["Hello, world", "The quick brown fox", "0 1 2 3"]


class OpenWatch:
    """Kernel-level record (inotify) of files opened or read in some directories, by any process."""

    def __init__(self, dirs):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.wds = {}
        for d in dirs:
            wd = self.libc.inotify_add_watch(self.fd, os.fsencode(d), IN_ACCESS | IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.wds[wd] = d

    def events(self) -> list[str]:
        out, buf = [], b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            buf += chunk
        i = 0
        while i + 16 <= len(buf):
            wd, mask, _, n = struct.unpack_from("iIII", buf, i)
            name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
            i += 16 + n
            kind = "open" if mask & IN_OPEN else "read"
            out.append(f"{kind}:{os.path.join(self.wds.get(wd, '?'), name)}")
        return out


def _model(llm):
    worker = llm.llm_engine.model_executor.driver_worker.worker
    return worker.model_runner


def unwrapped(model):
    """The model under vLLM's CUDA-graph and micro-batch wrappers (its V1 runner wraps MoE models, for one)."""
    while model is not None and callable(getattr(type(model), "unwrap", None)):
        model = model.unwrap()
    return model


def _dump_rank(worker, path: str) -> str:
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from weightcache.integrations.vllm.loader import engine_state

    out = f"{path}.rank{get_tensor_model_parallel_rank()}"
    model = unwrapped(worker.model_runner.model)
    torch.save({k: v.detach().cpu().clone() for k, v in engine_state(model).items()}, out)
    return out


def main(spec: dict) -> dict:
    watch = OpenWatch(spec["watch"]) if spec.get("watch") else None
    if spec.get("dump") and spec.get("tp", 1) > 1:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # test harness only: ships _dump_rank to workers
    from vllm import LLM, SamplingParams

    kw = dict(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_model_len", 128),
              enforce_eager=spec.get("enforce_eager", True), seed=0, max_num_seqs=4,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3), tensor_parallel_size=spec.get("tp", 1))
    if spec.get("quantization"):
        kw["quantization"] = spec["quantization"]
    if spec.get("ep"):
        kw["enable_expert_parallel"] = True
    if spec.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if spec.get("load_format"):
        kw["load_format"] = spec["load_format"]
    if spec.get("extra") is not None:
        kw["model_loader_extra_config"] = spec["extra"]
    if spec.get("speculative_config"):
        kw["speculative_config"] = spec["speculative_config"]
    if spec.get("tp", 1) > 1:
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12))
    prompts = spec.get("prompts", PROMPTS)

    def generate():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    result = {"tokens": generate()}
    cache = llm.llm_engine.vllm_config.cache_config
    result["kv_blocks"], result["block_size"] = cache.num_gpu_blocks, cache.block_size
    if watch is not None:
        result["opened"] = sorted(set(watch.events()))
    inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and spec.get("tp", 1) == 1
    if inproc:
        runner = _model(llm)
        model = unwrapped(runner.model)
        result["model_class"] = type(model).__name__
        result["attached"] = "_weightcache_attachment" in model.__dict__
        drafter = getattr(runner, "drafter", None)
        dmodel = unwrapped(getattr(drafter, "model", None))
        result["draft_attached"] = dmodel is not None and "_weightcache_attachment" in dmodel.__dict__
        if spec.get("dump"):
            import torch

            from weightcache.integrations.vllm.loader import engine_state

            state = {k: v.detach().cpu().clone() for k, v in engine_state(model).items()}
            if dmodel is not None:
                state.update({f"drafter.{k}": v.detach().cpu().clone() for k, v in engine_state(dmodel).items()})
            torch.save(state, spec["dump"])
        if spec.get("external_memory"):
            from vllm.model_executor.model_loader import get_model_loader

            cfg = llm.llm_engine.vllm_config
            result["external_memory"] = get_model_loader(cfg.load_config).get_external_weight_memory(cfg)
    if spec.get("dump") and not inproc:  # every worker saves its rank's state
        result["dumped"] = llm.collective_rpc(_dump_rank, args=(spec["dump"],))
    if spec.get("reload") is not None:
        try:
            llm.collective_rpc("reload_weights", kwargs=spec["reload"])
            result["reload"] = "ok"
        except Exception as e:
            result["reload"] = f"{type(e).__name__}: {e}"
        result["tokens_after_reload"] = generate()
    return result


if __name__ == "__main__":
    try:
        res = main(json.loads(sys.argv[1]))
    except BaseException as e:
        print("ERROR " + json.dumps({"type": type(e).__name__, "message": str(e),
                                     "traceback": traceback.format_exc()}), flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(res), flush=True)
