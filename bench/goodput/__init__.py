"""Goodput benchmarks: what recording costs the loop, and what the save-interval autopilot buys."""
