"""Storage and I/O: the store's files on a local disk or any fsspec URL (``storage``, ``remote``, ``cache``), the
threads that read them (``threads``), and the host memory reads land in (``buffers`` for samples, ``ring`` for
batches, ``pinned`` page-locking for CUDA, ``segments`` shared between DataLoader workers and the trainer)."""
