"""vLLM: ``producer`` (the daemon runs vLLM's own loader for its rank), ``loader`` (``--load-format
weightcache``), ``plugin`` (vLLM's plugin entry point), ``common`` (what producer and loader share) and
``compat`` (differences between vLLM releases, detected by capability)."""
