"""Checkpoint benchmarks: what a save costs the loop, its CPU and writes, restore after a
crash, restart after a kill, preemption, the GPU variant."""
