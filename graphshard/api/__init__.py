"""The user API: ``shard()`` and what it takes (mixed precision, offload, tensor
parallelism), gradient sync (``no_sync``), and the eager kernels of the marker ops.
"""
