"""The ``unbroken`` command: ls, verify, goodput, plan."""
