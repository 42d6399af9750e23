"""vLLM general plugin (entry point ``vllm.general_plugins: weightcache``).

vLLM runs general plugins in every process it starts (API server, engine core, workers), so each of them
knows ``--load-format weightcache``. Registering twice in one process is harmless.
"""

from __future__ import annotations

LOAD_FORMAT = "weightcache"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import WeightCacheModelLoader

    register_model_loader(LOAD_FORMAT)(WeightCacheModelLoader)
    _registered = True
    from .compat import install_memory_budget_shim

    # only where vLLM lacks get_external_weight_memory
    install_memory_budget_shim(lambda load_config, cfg: WeightCacheModelLoader(load_config)
                               .get_external_weight_memory(cfg))
