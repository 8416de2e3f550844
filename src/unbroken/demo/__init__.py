"""`unbroken demo`: the main job, trained through crashes, measured by goodput."""
