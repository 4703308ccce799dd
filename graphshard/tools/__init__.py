"""Command-line tools: ``graphshard dump/plan/calibrate``, offline tracing on a fake process
group, the what-if planner and hardware calibration.
"""
