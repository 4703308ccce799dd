"""Safety nets: guards against misuse of a sharded model, cross-rank fingerprints of the
plan, rank-failure reports, and workarounds for torch bugs that gave compiled models wrong
gradients silently or did not compile them (block regions that overwrote their inputs or read
an output at twice its storage offset, a layout optimization that dropped a gradient, torch
2.11's CPU backend losing a fused kernel's ordering or vectorizing a shared scalar).
"""
