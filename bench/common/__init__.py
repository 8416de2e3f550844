"""What every room shares: the real S3 server and its delay line, the JPEG workload,
process CPU accounting, and launching a module in a child process or under torchrun."""
