"""vLLM's own loader fed by weightcache's reader: the safetensors files vLLM's default loader picked (its own file
selection, filters and prefixes) are read by the fast fill, a batch at a time onto the rank's device, and handed
to the model's ``load_weights`` as device tensors; vLLM's weight loaders copy (and shard) them into its
parameters as they always do."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from ...reader.header import read_header
from ...reader.settings import ReadSettings
from ...reader.stream import CheckpointStream

log = logging.getLogger("weightcache.integrations.vllm.producer")

PLAIN_STRATEGIES = (None, "lazy", "prefetch")  # safetensors load strategies whose bytes are the files' as they are


def file_order(files: list[str], skip=None) -> tuple[dict, list[str]]:
    """The files' tensors (a name in two files: the later one) in read order (file by file, by offset)."""
    entries, order = {}, []
    for f in files:
        found = read_header(Path(f))[0]
        for n in sorted(found, key=lambda n: found[n].start):
            if skip is not None and skip(n):
                continue
            if n in entries:
                order.remove(n)
            entries[n] = found[n]
            order.append(n)
    return entries, order


@contextlib.contextmanager
def read_with_weightcache(device: torch.device, settings: ReadSettings, report=None, stats: dict | None = None):
    """Within the block, vLLM's default loader reads safetensors checkpoints with weightcache's reader."""
    from vllm.model_executor.model_loader import default_loader

    original = getattr(default_loader, "safetensors_weights_iterator", None)
    if original is None:
        log.warning("this vLLM has no safetensors_weights_iterator to replace: vLLM reads the checkpoint itself")
        yield
        return

    used = []

    def iterator(hf_weights_files, use_tqdm_on_load=False, safetensors_load_strategy=None, local_expert_ids=None,
                 *args, **kwargs):
        used.append(True)
        if safetensors_load_strategy not in PLAIN_STRATEGIES:
            log.info("safetensors load strategy %r: vLLM reads the checkpoint itself", safetensors_load_strategy)
            yield from original(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy, local_expert_ids,
                                *args, **kwargs)
            return
        skip = None
        if local_expert_ids is not None:
            from vllm.model_executor.model_loader.weight_utils import should_skip_weight

            def skip(name):
                return should_skip_weight(name, local_expert_ids)

        files = sorted(hf_weights_files, key=_natural_key)
        entries, order = file_order(files, skip)
        with CheckpointStream(entries, order, device, settings, report=report) as stream:
            yield from stream
            if stats is not None:
                stats["reread"] = stats.get("reread", 0) + stream.reread
                stats["nbytes"] = stats.get("nbytes", 0) + stream.nbytes
                for k, v in stream.timings.items():
                    stats[f"load: {k}"] = stats.get(f"load: {k}", 0.0) + v

    default_loader.safetensors_weights_iterator = iterator
    try:
        yield
    finally:
        default_loader.safetensors_weights_iterator = original
    if not used:
        log.warning("the checkpoint is not safetensors (or vLLM's loader read it another way): vLLM read it "
                    "itself, at its own speed")


def _natural_key(path: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]
