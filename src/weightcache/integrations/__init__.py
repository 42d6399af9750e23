"""How engines produce and take weights: one folder per framework (``transformers/``, ``vllm/``), each with a
producer (runs in the daemon: the engine's own loader builds the rank's tensors) and an engine half (binds
attached tensors); ``torch.py`` binds into any ``nn.Module``; ``model_state.py`` walks what a built model
holds. An engine half never imports its producer: what both need sits in the folder's ``compat``/``common``."""
