"""Verified resident weights: a digest of every chunk of every arena block, computed where the bytes live when
a cache is loaded, recorded in its manifest, and checked again on demand (``weightcache verify``,
``attach(verify=True)``), after an adoption from the custodian, and by a periodic scrub."""

from .algorithm import DEFAULT_CHUNK_BYTES, NAME
from .resident import IntegrityError, block_digests, check, describe, record, tensors_in_chunks

__all__ = ["DEFAULT_CHUNK_BYTES", "NAME", "IntegrityError", "block_digests", "check", "describe", "record",
           "tensors_in_chunks"]
