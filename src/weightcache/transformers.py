"""``weightcache.transformers.from_pretrained``: transformers models over cached weights (see engines/transformers.py)."""

from .integrations.transformers.engine import (
           NoDaemonWarning,
           engine_version,
           from_pretrained,
           key_for_checkpoint,
           resolve_dtype,
           snapshot_revision,
)

__all__ = ["NoDaemonWarning", "engine_version", "from_pretrained", "key_for_checkpoint", "resolve_dtype",
           "snapshot_revision"]
