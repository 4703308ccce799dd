"""Safety nets: guards against misuse of a sharded model, cross-rank fingerprints of the
plan, rank-failure reports, and the workaround for a torch bug that let compiled block
regions overwrite their inputs.
"""
