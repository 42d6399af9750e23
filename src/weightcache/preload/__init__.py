"""`weightcache preload`: front ends (``frontend`` for the transformers and safetensors engines,
``vllm_frontend`` for vLLM's own flags), their shared ``options``, the ``supervisor`` that runs one ``child``
daemon process per (``group``, placement), the ``layout`` of ranks, the multi-node ``rendezvous``, the
custodian policy (``holding``) and ``http`` (/health, /metrics, /status)."""
