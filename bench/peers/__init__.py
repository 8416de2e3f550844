"""unbroken beside the libraries users would pick instead: data loaders, checkpointers,
and the frameworks' own saves."""
