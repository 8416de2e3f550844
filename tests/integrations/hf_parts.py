"""The model, data and Trainer of the Hugging Face tests (in-process and under torchrun)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import transformers

from unbroken.integrations.hf import Trainer

SEQ = 16


def decode(data: bytes, key: str) -> dict:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return {"input_ids": ids, "labels": ids}


def gpt2() -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config (no download), dropout on: the RNG matters."""
    transformers.set_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def training_args(out: str, steps: int, **overrides) -> transformers.TrainingArguments:
    """save_steps=4: the Trainer's own checkpoints would go to out/hf-output/checkpoint-*."""
    options = dict(
        output_dir=os.path.join(out, "hf-output"), max_steps=steps,
        per_device_train_batch_size=2, learning_rate=1e-3, warmup_steps=3,
        save_strategy="steps", save_steps=4, logging_steps=1000, report_to=[],
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    options.update(overrides)
    return transformers.TrainingArguments(**options)


class Records:
    """A Trainer mixin telling ``seen(step, ids)`` each batch's sample ids."""

    seen: Callable[[int, list[int]], None] = staticmethod(lambda step, ids: None)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen(self.state.global_step + 1, inputs["input_ids"][:, 0].tolist())
        return super().training_step(model, inputs, num_items_in_batch)


class Recording(Records, Trainer):
    """unbroken's Trainer, recording."""


class RecordingTheirs(Records, transformers.Trainer):
    """transformers' own Trainer (and DataLoader), recording."""
