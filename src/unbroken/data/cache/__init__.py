"""The node-wide local cache of remote files: fills, locks, eviction."""
