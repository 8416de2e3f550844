"""Run by test_elastic_env.py under real torchrun: build a manager, print its warnings."""

import sys
import warnings

import unbroken as ub

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2]).close()
    ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2]).close()
hits = [w for w in caught if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in str(w.message)]
print(f"RESTART-WARNINGS {len(hits)}")
for w in hits:
    print(f"WARNING {w.message}")
