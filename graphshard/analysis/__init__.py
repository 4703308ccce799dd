"""Analysis of compiled graphs: per-bucket and per-step reports, simulated timelines.
"""
