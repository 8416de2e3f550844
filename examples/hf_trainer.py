"""A Hugging Face Trainer job that survives crashes and preemption, one line added.

    python examples/hf_trainer.py --make-data /data/tokens          # a toy token volume
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/hf_trainer.py --data /data/tokens --checkpoints s3://bucket/gpt2-1

A GPT-2 built from a config (no download) trains on a directory of raw token files
through unbroken's Trainer (the data position is exact) with ``UnbrokenCallback``: saves
are asynchronous and committed every ``save_steps``, a restart resumes the newest
committed step by itself (weights, AdamW, schedule, RNG, data position), and a SIGTERM
saves the step reached before the process ends. Runs on CPUs (gloo) and GPUs.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import transformers

import unbroken as ub
from unbroken.integrations.hf import Trainer, UnbrokenCallback

CONTEXT = 64


def decode(data: bytes, key: str) -> dict:
    """A file of little-endian uint16 token ids -> one training sequence."""
    ids = torch.from_numpy(np.frombuffer(data, dtype="<u2").astype(np.int64))
    return {"input_ids": ids, "labels": ids}


def make_data(root: str, files: int = 512) -> None:
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        tokens = rng.integers(0, 256, CONTEXT, dtype="<u2")
        with open(os.path.join(root, f"{i:05d}.bin"), "wb") as f:
            f.write(tokens.tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="URL of the token volume (a path, s3://...)")
    parser.add_argument("--checkpoints", help="durable checkpoint URL (a path, s3://...)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--make-data", metavar="DIR", help="write a toy volume there, exit")
    args = parser.parse_args()
    if args.make_data:
        return make_data(args.make_data)
    if not (args.data and args.checkpoints):
        parser.error("--data and --checkpoints are required")
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    transformers.set_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=128, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    training = transformers.TrainingArguments(
        output_dir="hf-output",  # stays empty: the callback replaces the Trainer's saves
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-4,
        warmup_steps=20,
        save_steps=20,  # unbroken's interval too
        logging_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if several and not torch.cuda.is_available() else None,
    )
    trainer = Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=training,
        train_dataset=ub.VolumeDataset(args.data, decode=decode, seed=0),
        callbacks=[UnbrokenCallback(args.checkpoints)],  # the one line
    )
    trainer.train()


if __name__ == "__main__":
    main()
