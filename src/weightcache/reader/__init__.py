"""How checkpoint bytes get into memory, fast: safetensors headers (``header``), reading settings
(``settings``), the read plan (``read_plan``: pieces and segments), file mappings and page-cache residency
(``filemap``), CPU reads (``reading``), the CUDA fill (``cuda_fill``) with its native window loop
(``native_fill``, ``native/fill_loop.c``) and InstantTensor (``instanttensor``, optional)."""
