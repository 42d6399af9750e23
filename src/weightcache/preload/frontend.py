"""`weightcache preload` with the transformers (default) and safetensors engines: flags named like vLLM's, checks before any daemon starts, the daemon groups."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import LayoutError
from .layout import Layout, LoopbackLayout
from .options import (
    UsageError,
    add_weight_cache_arguments,
    configure_logging,
    non_negative_int,
    positive_int,
    resolve_socket_dir,
    run_supervisor,
)

ENGINES = ("transformers", "safetensors", "vllm")

PRELOAD_DESCRIPTION = """\
Start one weight cache daemon per rank of this node (DP x PP x TP, +EP) and hold the model's weights
until SIGINT/SIGTERM. Flags are named like vLLM's, so a launch line can be reused."""
PRELOAD_EPILOG = """\
examples:
  weightcache preload --model /models/llama -tp 8 --weight-cache-health-port 8081
  weightcache preload --model /models/llama --speculative-model /models/llama-draft -tp 4
  # two nodes, TP 16 (run on each node with its --node-rank):
  weightcache preload --model /models/big -tp 16 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
      --weight-cache-master-port 29600"""


def add_preload_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `preload` flags (named like vLLM's); reusable by other preload front ends."""
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="checkpoint directory (or use --model)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (Hugging Face layout: config.json + *.safetensors)")
    p.add_argument("--engine", choices=ENGINES, default="transformers",
                   help="who produces the weights: transformers' own from_pretrained (transformers, default; "
                        "MoE, quantized checkpoints, its tensor/expert parallel plans), the raw checkpoint "
                        "tensors sharded by a TP plan (safetensors) or vLLM's own loader (vllm)")
    p.add_argument("--revision", default="", metavar="REV", help="model revision recorded in the cache key")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16, float32, ...")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the weights live (default: cuda when available, else cpu)")
    p.add_argument("--tp-plan", default=None, metavar="JSON|FILE",
                   help="--engine safetensors: tensor-parallel plan (pattern -> colwise/rowwise/...); default: "
                        "transformers' plan for the model's architecture")
    par = p.add_argument_group("parallel layout (as vLLM)")
    par.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N")
    par.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1, metavar="N")
    par.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, metavar="N")
    par.add_argument("--data-parallel-size-local", "-dpl", type=positive_int, default=None, metavar="N",
                     help="DP ranks on this node (DP across nodes)")
    par.add_argument("--data-parallel-rank", "-dpn", type=non_negative_int, default=None, metavar="R",
                     help="this node's first DP rank (alone: one DP rank per launch)")
    par.add_argument("--data-parallel-address", "-dpa", default=None, metavar="ADDR",
                     help="node 0's address (DP across nodes)")
    par.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    par.add_argument("--nnodes", "-n", type=positive_int, default=1, metavar="N", help="nodes the ranks span")
    par.add_argument("--node-rank", "-r", type=non_negative_int, default=0, metavar="R")
    par.add_argument("--master-addr", default=None, metavar="ADDR",
                     help="node 0's address (default 127.0.0.1 on one node)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-model", "--draft-model", dest="draft_model", default=None, metavar="DIR",
                      help="draft model checkpoint: a second daemon group with role 'draft'")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='vLLM-style JSON; its "model" (and "draft_tensor_parallel_size") are used')
    spec.add_argument("--draft-tensor-parallel-size", type=positive_int, default=None, metavar="N",
                      help="TP size of the draft group (default: the main model's)")
    add_weight_cache_arguments(p)
    return p


def _speculative(args) -> None:
    if not args.speculative_config:
        return
    try:
        cfg = json.loads(args.speculative_config)
    except ValueError as e:
        raise UsageError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UsageError("--speculative-config must be a JSON object")
    model = cfg.get("model")
    if model and args.draft_model and model != args.draft_model:
        raise UsageError(f"--speculative-config model {model!r} differs from --speculative-model "
                         f"{args.draft_model!r}")
    if model:
        args.draft_model = model
    if cfg.get("draft_tensor_parallel_size") and not args.draft_tensor_parallel_size:
        args.draft_tensor_parallel_size = int(cfg["draft_tensor_parallel_size"])


def layouts_from_args(args, device_type: str, local_devices: int | None):
    """(main layout, draft layout or None) from the parsed flags; refuses bad combinations clearly."""
    kw = dict(
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size, data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_rank=args.data_parallel_rank, data_parallel_address=args.data_parallel_address,
        enable_expert_parallel=args.enable_expert_parallel, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, device_type=device_type, local_devices=local_devices,
    )
    cls = LoopbackLayout if args.weight_cache_allow_loopback_nodes else Layout
    try:
        main = cls.from_vllm_args(**kw)
        draft = None
        if args.draft_model:
            dtp = args.draft_tensor_parallel_size or args.tensor_parallel_size
            draft = cls.from_vllm_args(**{**kw, "tensor_parallel_size": dtp, "role": "draft"})
            if draft.local_size != main.local_size and dtp not in (1, args.tensor_parallel_size):
                raise LayoutError(f"draft tensor parallel size {dtp} must be 1 or the main model's "
                                  f"({args.tensor_parallel_size})")
    except LayoutError as e:
        raise UsageError(str(e)) from None
    return main, draft


def resolve_ports(args, nodes: int, has_draft: bool) -> tuple[int, int]:
    """(main port, draft port); 0 means a free port chosen at start (single node only)."""
    main = args.weight_cache_master_port or 0
    draft = args.weight_cache_draft_master_port or 0
    if nodes > 1 and not main:
        raise UsageError(f"the daemons span {nodes} nodes: pass --weight-cache-master-port (the same on "
                         "every node; a port node 0 can listen on)")
    if has_draft and nodes > 1 and not draft:
        draft = main + 1
        if draft > 65535:
            raise UsageError("--weight-cache-master-port 65535 leaves no port for the draft group; "
                             "pass --weight-cache-draft-master-port")
    if has_draft and main and draft and main == draft:
        raise UsageError(f"the main and draft groups need different rendezvous ports, both are {main}: "
                         "change --weight-cache-draft-master-port")
    return main, draft


def checkpoint_source(placement, *, path: str, dtype: str = "auto", tp_plan=None, threads: int | None = None):
    """The checkpoint source, built in each daemon process for its placement. dtype "auto" keeps the
    files' dtypes."""
    from ..dtypes import parse_dtype
    from ..sources.safetensors import SafetensorsSource

    return SafetensorsSource(
        path, dtype=None if dtype in ("auto", "", None) else parse_dtype(dtype), tp_rank=placement.tp_rank,
        tp_size=placement.tp_size, tp_plan=tp_plan, device=placement.device, threads=threads,
        progress=placement.local_index == 0,  # one progress bar per node
    )


def transformers_source(placement, **kwargs):
    """transformers' own from_pretrained, run in each daemon process for its placement."""
    from ..integrations.transformers.producer import TransformersSource

    return TransformersSource(placement, **kwargs)


def transformers_key(source, placement, *, layout: str, role: str, **_):
    """The key the transformers engine expects (``key_for_checkpoint``), computed by the source."""
    from ..integrations.transformers.producer import make_key

    return make_key(source, placement, layout=layout, role=role)


def _check_transformers_layout(args, path: str) -> None:
    """Refuse, before any daemon starts, a layout transformers' own loader cannot build."""
    tp = args.tensor_parallel_size
    if args.pipeline_parallel_size > 1:
        raise UsageError("--engine transformers has no pipeline-parallel split; use --pipeline-parallel-size 1 "
                         "or --engine vllm")
    if args.tp_plan:
        raise UsageError("--tp-plan applies to --engine safetensors; --engine transformers shards with "
                         "transformers' own plan")
    if tp == 1:
        if args.enable_expert_parallel:
            raise UsageError("--enable-expert-parallel with --engine transformers spreads the experts over the "
                             "tensor-parallel ranks (transformers' expert parallel plan): add -tp N")
        return
    if args.data_parallel_size > 1:
        raise UsageError(f"--engine transformers with -tp {tp}: transformers' tensor parallel world is the TP "
                         "group alone; use --data-parallel-size 1, or --engine vllm")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise UsageError(f"model {path}: transformers cannot read its config: {e}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = "base_model_ep_plan" if args.enable_expert_parallel else "base_model_tp_plan"
    if not getattr(text, plan, None):
        what = "expert parallel" if args.enable_expert_parallel else "tensor parallel"
        raise UsageError(f"model {path} ({type(config).__name__}): transformers has no {what} plan for it "
                         f"({plan} is empty), so it cannot shard it over -tp {tp}; use -tp 1, --engine vllm, or "
                         "--engine safetensors --tp-plan ... for your own sharded module")
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise UsageError(f"--engine transformers with -tp {tp}: transformers' tensor parallel loading needs "
                         "accelerate (pip install accelerate)")


def _check_config(role: str, path: str, tp_size: int, tp_plan) -> None:
    """config.json (when there is one) must be a JSON object, and a TP size must split the model the way
    transformers' plan does: refused here, before any daemon starts."""
    from ..sources.tp_plan import TPPlanError, check_tp_size

    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{role} model: {cfg_path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{role} model: {cfg_path}: not a model config (a JSON {type(cfg).__name__}, not an object)")
    if tp_plan in (None, "auto"):
        try:
            check_tp_size(cfg, tp_size)
        except TPPlanError as e:
            raise UsageError(f"{role} model {path}: {e}") from None


TORCH_WEIGHTS = (".bin", ".pt", ".pth")  # what transformers also reads, besides safetensors


def _check_weights(role: str, path: str, engine: str) -> None:
    """A directory must hold weights in a format the engine reads (GGUF alone is refused with a hint), told by
    the file names only: no weight file is opened here (a preload that takes its caches from the custodian
    reads none). What is inside them is the daemons' to check, each failure in one line."""
    p = Path(path)
    if not p.is_dir():
        return
    try:
        found = sorted({f.suffix for f in p.iterdir() if f.suffix in (".safetensors", *TORCH_WEIGHTS, ".gguf")})
    except OSError as e:
        raise UsageError(f"{role} model {path}: {e}") from None
    readable = {".safetensors"} if engine == "safetensors" else {".safetensors", *TORCH_WEIGHTS}
    if not readable & set(found):
        raise UsageError(f"{role} model {path}: no weights --engine {engine} reads (it reads "
                         f"{', '.join('*' + x for x in sorted(readable))}; found "
                         f"{', '.join('*' + x for x in found) or 'none'})"
                         + ("; convert the GGUF file to safetensors" if ".gguf" in found else ""))


def _check_local_ranks(device: str, layouts) -> None:
    """On CPU every local rank is a daemon process of its own: refuse more of them than this machine has CPUs
    (on CUDA the layout already refuses more ranks than visible devices)."""
    if device != "cpu":
        return
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for lay in layouts:
        if lay.local_size > cpus:
            raise UsageError(f"{lay.role}: this node would run {lay.local_size} daemon(s) ({lay.describe()}) on "
                             f"--device cpu but only {cpus} CPU(s) are available; use smaller parallel sizes or "
                             "more nodes")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_plan(text: str | None):
    if not text:
        return None
    if text in ("auto", "none"):
        return text
    try:
        raw = Path(text).read_text() if not text.lstrip().startswith("{") else text
        plan = json.loads(raw)
    except (OSError, ValueError) as e:
        raise UsageError(f"--tp-plan {text!r}: not a JSON object or a readable JSON file ({e})") from None
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise UsageError('--tp-plan must map tensor patterns to styles, e.g. {"layers.*.mlp.down_proj": "rowwise"}')
    return plan


def cuda_device_count() -> int:
    """Visible CUDA devices, from the driver (no torch: the daemons import it, in parallel); torch where
    cuda-bindings is missing."""
    from ..gpus import cuda_device_count as from_driver

    count = from_driver()
    if count is None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count


def preload_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weightcache preload", description=PRELOAD_DESCRIPTION,
                                     epilog=PRELOAD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preload_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return _preload(args, argv)
    except UsageError as e:
        print(f"weightcache preload: error: {e}", file=sys.stderr)
        return 2


def _preload(args, argv: list[str]) -> int:
    from .supervisor import Group

    model = args.model or args.model_pos
    if not model:
        raise UsageError("no model: pass --model DIR")
    if args.model and args.model_pos and args.model != args.model_pos:
        raise UsageError(f"two models given: {args.model_pos!r} and --model {args.model!r}")
    _speculative(args)
    for name, path in (("--model", model), ("--speculative-model", args.draft_model)):
        if path and not Path(path).exists():
            raise UsageError(f"{name} {path}: no such file or directory")
    device = args.device
    visible = 0 if device == "cpu" else cuda_device_count()
    if device is None:
        device = "cuda" if visible else "cpu"
    if device == "cuda" and not visible:
        raise UsageError("--device cuda but no CUDA device is visible (check CUDA_VISIBLE_DEVICES / drivers)")
    local_devices = visible if device == "cuda" else None
    main_layout, draft_layout = layouts_from_args(args, device, local_devices)
    main_port, draft_port = resolve_ports(args, main_layout.nodes, draft_layout is not None)
    master_addr = args.master_addr or args.data_parallel_address or "127.0.0.1"
    tp_plan = _tp_plan(args.tp_plan)
    plans = [("main", model, main_layout, main_port)]
    if draft_layout is not None:
        plans.append(("draft", args.draft_model, draft_layout, draft_port))
    for role, path, layout, _ in plans:
        _check_config(role, path, layout.tp, tp_plan)
    roles, world = [p[0] for p in plans], max(p[2].world_size for p in plans)
    resolve_socket_dir(args.weight_cache_socket_dir, roles, world, device, create=False)  # refused before any work

    if args.engine == "transformers":
        _check_transformers_layout(args, model)
    else:
        if args.pipeline_parallel_size > 1:
            raise UsageError("the checkpoint source has no pipeline-parallel split; use --pipeline-parallel-size 1 "
                             "or --engine vllm")
        if args.enable_expert_parallel:
            raise UsageError("the checkpoint source does not shard experts over DP x TP; drop "
                             "--enable-expert-parallel or use --engine transformers / vllm")
    dtype = args.dtype
    if dtype not in ("auto", ""):
        from ..dtypes import parse_dtype

        try:
            parse_dtype(dtype)
        except ValueError as e:
            raise UsageError(f"--dtype: {e}") from None

    _check_local_ranks(device, [p[2] for p in plans])
    for role, path, _, _ in plans:
        _check_weights(role, path, args.engine)  # every refusal before any hashing starts
    from ..digests import start_checkpoint_digest

    groups, digests = [], []
    for role, path, layout, port in plans:
        try:  # hashed once, here, while the daemons start; they wait for it, then only stat() the files
            digests.append((f"{role} model {path}", start_checkpoint_digest(path, nice=10, in_a_process=True)))
        except OSError as e:
            raise UsageError(f"{role} model {path}: {e}") from None
        if args.engine == "transformers":
            from ..integrations.transformers.config import model_modules, resolve_dtype_name

            try:
                src_dtype = resolve_dtype_name(path, dtype)  # what from_pretrained would load
            except (OSError, ValueError) as e:
                raise UsageError(f"{role} model {path}: {e}") from None
            if args.tensor_parallel_size > 1 and not port:
                port = _free_port()  # the daemons' own torch.distributed world meets there
            groups.append(Group(
                role=role, layout=layout, make_source=transformers_source, make_key=transformers_key,
                source_args={"path": str(path), "dtype": src_dtype, "revision": args.revision, "role": role,
                             "enable_expert_parallel": args.enable_expert_parallel, "master_addr": master_addr,
                             "master_port": port},
                master_addr=master_addr, master_port=port, info={"engine": args.engine},
                loads_alone=args.tensor_parallel_size == 1,  # tensor parallel ranks load in one process group
                preimport=model_modules(path)))
            continue
        groups.append(Group(role=role, layout=layout, make_source=checkpoint_source,
                            source_args={"path": str(path), "dtype": dtype, "tp_plan": tp_plan},
                            key_args={"revision": args.revision}, master_addr=master_addr, master_port=port,
                            info={"engine": args.engine}))
    socket_dir = resolve_socket_dir(args.weight_cache_socket_dir, roles, world, device)
    return run_supervisor(groups, socket_dir, args, argv=argv, checkpoints=[p[1] for p in plans], digests=digests)
