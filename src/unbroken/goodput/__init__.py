"""Goodput: the job's events (recorded by the manager and the loader), the breakdown of
its wall time (pure), and the failure-rate planner (pure)."""
