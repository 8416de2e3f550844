"""Run by test_hf.py under torchrun: a 2-layer GPT-2 (from a config) under transformers'
Trainer, with unbroken's callback and Trainer, reading a VolumeDataset.

argv: out dir, volume dir, max steps. ``FAULTS`` (env): ``attempt:rank:kill|term:step``
entries, comma-separated: that rank SIGKILLs (after its last save is committed) or
SIGTERMs itself at that step of that attempt. Each rank prints ``STEP rank attempt step``
before the step's maybe_save, ``SEEN rank attempt step ids`` (each sample's first token:
its file index), ``RESTORED rank attempt step`` and ``DONE rank attempt digest``.
"""

import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist
import transformers

import unbroken as ub
from unbroken.integrations.hf import Trainer, UnbrokenCallback

out, volume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
faults = [f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f]
SEQ = 16


def decode(data: bytes, key: str) -> dict:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return {"input_ids": ids, "labels": ids}


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
        print(f"STEP {rank()} {attempt} {state.global_step}", flush=True)
        for a, r, what, step in faults:
            if (int(a), int(r), int(step)) == (attempt, rank(), state.global_step):
                if what == "kill":
                    self.checkpoints.manager.wait()  # the restart resumes from a known step
                    os.kill(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGTERM)


class Recording(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs["input_ids"][:, 0].tolist()
        print(f"SEEN {rank()} {attempt} {self.state.global_step + 1} {ids}", flush=True)
        return super().training_step(model, inputs, num_items_in_batch)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


args = transformers.TrainingArguments(
    output_dir=os.path.join(out, "hf-output"),
    max_steps=max_steps,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    warmup_steps=3,
    save_strategy="steps",
    save_steps=4,  # the Trainer's own checkpoints would go to hf-output/checkpoint-*
    logging_steps=1000,
    report_to=[],
    use_cpu=True,
    ddp_backend="gloo",
    ddp_find_unused_parameters=False,
    seed=0,
    dataloader_num_workers=int(os.environ.get("WORKERS", "0")),
    disable_tqdm=True,
)
transformers.set_seed(0)
config = transformers.GPT2Config(
    vocab_size=256,
    n_positions=SEQ,
    n_embd=32,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.1,
    bos_token_id=0,
    eos_token_id=0,
)
model = transformers.GPT2LMHeadModel(config)
checkpoints = UnbrokenCallback(
    os.path.join(out, "ckpt"),
    staging_dir=os.path.join(out, "stage", os.environ.get("RANK", "0")),
    when_busy="wait",
)
trainer = Recording(
    model=model,
    args=args,
    train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
    callbacks=[Faults(checkpoints), checkpoints],
)
trainer.train()
state = trainer.optimizer.optimizer.state
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
    for name in sorted(state[p]):  # a restored state may hold its keys in another order
        digest.update(state[p][name].numpy().tobytes())
print(f"DONE {rank()} {attempt} {digest.hexdigest()}", flush=True)
