"""Safety nets: guards against misuse of a sharded model, cross-rank fingerprints of the
plan, and rank-failure reports.
"""
