"""The on-disk format of both tiers: DCP writer/reader, tensor records, the manifest."""
