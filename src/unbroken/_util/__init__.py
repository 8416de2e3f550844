"""Small helpers shared by every subpackage (no I/O policy lives here)."""
