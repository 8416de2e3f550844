"""Every Python process a multi-process test starts says where it is on SIGUSR1.

The test launchers put this folder on ``PYTHONPATH``, so ranks, their forked DataLoader
workers, save helpers and the torchrun agent all load it; a test that gives up on a hung
job signals the whole tree first (``distributed.dump_stacks``), and the job's output then
holds every thread's stack.
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
