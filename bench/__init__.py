"""Benchmarks of graphshard against FSDP2, DDP and a single process: ``python -m bench.step``."""
