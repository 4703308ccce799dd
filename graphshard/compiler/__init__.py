"""The compiler: the ``graphshard`` torch.compile backend, the pass pipeline it runs
per stage, graph-break accounting and graph dumps.
"""
