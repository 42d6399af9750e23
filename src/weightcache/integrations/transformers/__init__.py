"""transformers: ``producer`` (the daemon runs ``from_pretrained``), ``engine`` (``from_pretrained`` that binds
the daemon's tensors) and ``compat`` (what both share: the key, the walking rules, the loading switch)."""
