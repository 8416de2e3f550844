"""What the link carries: uploads and downloads through the emulated remote and real S3."""
