"""Run by test_hf.py under torchrun: a 2-layer GPT-2 (from a config) under transformers'
Trainer, with unbroken's callback and Trainer, reading a VolumeDataset.

argv: out dir, volume dir, max steps. ``FAULTS`` (env): ``attempt:rank:kill|term:step``
entries, comma-separated: that rank SIGKILLs (after its last save is committed) or
SIGTERMs itself at that step of that attempt. Each rank prints ``STEP rank attempt step``
before the step's maybe_save, ``SEEN rank attempt step ids`` (each sample's first token:
its file index), ``RESTORED rank attempt step`` and ``DONE rank attempt digest``.
"""

import os
import sys
import time

import torch.distributed as dist
import transformers

import unbroken as ub
from tests.integrations.hf_parts import Recording, decode, gpt2, training_args
from tests.integrations.runs import act_on, digest
from unbroken.integrations.hf import UnbrokenCallback

out, volume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = os.environ.get("FAULTS", "")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Faults(transformers.TrainerCallback):
    """Prints each step, and ends this rank as FAULTS says (before the step's save)."""

    def __init__(self, checkpoints: UnbrokenCallback) -> None:
        self.checkpoints = checkpoints

    def on_train_begin(self, args, state, control, **kwargs):
        self.first = True

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first:  # after every on_train_begin: the restore has run
            restored = self.checkpoints.restored_step or 0
            print(f"RESTORED {rank()} {attempt} {restored}", flush=True)
            self.first = False

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.05)  # 50 ms steps: the ranks agree on a SIGTERM within a few
        print(f"STEP {rank()} {attempt} {state.global_step}", flush=True)
        act_on(FAULTS, attempt, rank(), state.global_step, self.checkpoints.manager.wait)


args = training_args(out, max_steps, dataloader_num_workers=int(os.environ.get("WORKERS", "0")))
model = gpt2()
checkpoints = UnbrokenCallback(
    os.path.join(out, "ckpt"),
    staging_dir=os.path.join(out, "stage", os.environ.get("RANK", "0")),
    when_busy="wait",
)
Recording.seen = staticmethod(
    lambda step, ids: print(f"SEEN {rank()} {attempt} {step} {ids}", flush=True)
)
trainer = Recording(
    model=model,
    args=args,
    train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
    callbacks=[Faults(checkpoints), checkpoints],
)
trainer.train()
print(f"DONE {rank()} {attempt} {digest(model, trainer.optimizer.optimizer)}", flush=True)
