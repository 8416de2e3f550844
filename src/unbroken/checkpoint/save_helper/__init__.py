"""A save's uploads in a process of its own, beside the training process.

The training process copies its state into the host buffers and writes the node's copy
(the memory tier); the uploads of those files to the durable tier then run here, so
their threads, HTTP clients and checksum reads take no turn of the training process's
interpreter. Nothing of the user's state crosses: the helper gets the store as JSON
(``storage/spec.py``) and file paths in the memory tier, and reads the bytes itself.
"""
