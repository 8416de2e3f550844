"""State -> reused host buffers: the foreground half of a save, overlapped with compute."""
