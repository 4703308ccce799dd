"""Benchmarks of graphshard against FSDP2, DDP and a single process: ``python -m bench.step``.

``step`` is the entry point and runs the ranks; ``timing``, ``memory``, ``comm`` and ``report``
define the numbers and never import ``step``, so each can be read and tested on its own.
"""
