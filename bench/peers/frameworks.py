"""How long a save blocks the training loop: each framework's own checkpointing beside the
same run with unbroken (same model, data, interval), in one process on the CPU.

- Hugging Face ``Trainer`` (GPT-2 from a config): its own ``save_steps`` checkpoint
  (``model.safetensors``, ``optimizer.pt``, scheduler, RNG, ``trainer_state.json``, all
  written before the next step) against ``UnbrokenCallback`` at the same interval.
- Lightning ``Trainer`` (an MLP): ``ModelCheckpoint(every_n_train_steps=...)`` through the
  default ``TorchCheckpointIO`` (``torch.save`` of the whole dict) against the same
  callback through ``UnbrokenCheckpointIO``.

"blocked" is the time the save call took on the loop's thread, the first save apart
(it allocates what the others reuse). For unbroken that is building the state and
starting its copy into host buffers; the write, upload and commit run behind the next
steps. "loop" is the training's wall time, which also shows what the background
work costs the steps on a machine this small. The load (``os.getloadavg``) is printed
before and after: the figures mean little without it. Both frameworks run once with one
save first (imports, first allocations), unmeasured.

A save due while the previous one is still being written waits for it (the host buffers
are reused): at 10 steps between saves (0.3 s of Lightning steps here) the background
write, on the same 2 cores as the steps, does not land in time and each save waits about
50 ms. The default interval, 40 steps, leaves it room.

    python -m bench.peers.frameworks [--quick] [--saves 3] [--every 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import unbroken as ub


def _volume(root: Path, files: int, tokens: int) -> Path:
    volume = root / "volume"
    volume.mkdir()
    for i in range(files):
        (volume / f"{i:05d}.bin").write_bytes(bytes((i * 7 + j) % 256 for j in range(tokens)))
    return volume


def _decode_tokens(data: bytes, key: str) -> dict:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return {"input_ids": ids, "labels": ids}


def _state_mib(model: torch.nn.Module) -> float:
    """Weights plus Adam's two moments, fp32."""
    return 3 * sum(p.numel() for p in model.parameters()) * 4 / 2**20


def bench_hf(work: Path, volume: Path, a: argparse.Namespace) -> list[dict]:
    import transformers

    from unbroken.integrations.hf import Trainer, UnbrokenCallback

    seconds: list[float] = []

    class Timed(Trainer):
        def _save_checkpoint(self, model, trial):  # the Trainer's own save, on the loop
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            seconds.append(time.perf_counter() - t0)

    class TimedCallback(UnbrokenCallback):
        def on_step_end(self, args, state, control, **kwargs):  # maybe_save, on the loop
            started, t0 = self.manager.stats.started, time.perf_counter()
            super().on_step_end(args, state, control, **kwargs)
            if self.manager.stats.started > started:
                seconds.append(time.perf_counter() - t0)

    rows = []
    for mode in ("own", "unbroken"):
        transformers.set_seed(0)
        config = transformers.GPT2Config(
            vocab_size=8192, n_positions=a.tokens, n_embd=a.width, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        out = work / f"hf-{mode}"
        args = transformers.TrainingArguments(
            output_dir=str(out / "output"), max_steps=a.every * a.saves,
            per_device_train_batch_size=4, save_strategy="steps", save_steps=a.every,
            save_total_limit=2, logging_steps=10_000, report_to=[], use_cpu=True,
            disable_tqdm=True,
        )  # fmt: skip
        callbacks, manager = [], None
        if mode == "unbroken":
            manager = ub.CheckpointManager(
                out / "ckpt", staging_dir=out / "stage", every_steps=a.every, when_busy="wait"
            )
            callbacks = [TimedCallback(manager)]
        seconds.clear()
        trainer = Timed(
            model=model, args=args, callbacks=callbacks,
            train_dataset=ub.VolumeDataset(str(volume), decode=_decode_tokens, seed=0),
        )  # fmt: skip
        t0 = time.perf_counter()
        trainer.train()
        loop = time.perf_counter() - t0
        commit = None
        if manager is not None:
            manager.wait()
            commit = manager.stats.last_commit_seconds
            manager.close()
        rows.append(_row("HF Trainer", mode, model, list(seconds), commit, loop))
    return rows


def bench_lightning(work: Path, volume: Path, a: argparse.Namespace) -> list[dict]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from unbroken.integrations.lightning import UnbrokenCheckpointIO

    seconds: list[float] = []

    class Timed(ModelCheckpoint):
        def _save_checkpoint(self, trainer, filepath):  # dump + the plugin's save
            t0 = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            seconds.append(time.perf_counter() - t0)

    class MLP(L.LightningModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            layers = [torch.nn.Linear(a.tokens, width), torch.nn.ReLU()]
            for _ in range(3):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

        def training_step(self, batch, idx):
            x = batch["input_ids"].float() / 255
            return (self.net(x).squeeze(1) - x.mean(1)).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    rows = []
    for mode in ("own", "unbroken"):
        L.seed_everything(0, verbose=False)
        model, out = MLP(a.mlp_width), work / f"lightning-{mode}"
        io, plugins, callbacks = None, [], []
        if mode == "unbroken":  # the ModelCheckpoint below sets the interval, as in "own"
            io = UnbrokenCheckpointIO(out / "ckpt", staging_dir=out / "stage", every_steps=None)
            plugins, callbacks = [io], [io.callback]
        timed = Timed(dirpath=out / "lightning-checkpoints", every_n_train_steps=a.every)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=a.every * a.saves, logger=False,
            enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
            callbacks=[timed, *callbacks], default_root_dir=out,
        )  # fmt: skip
        loader = ub.DataLoader(
            ub.VolumeDataset(str(volume), decode=_decode_tokens, seed=0), batch_size=4
        )
        seconds.clear()
        commit = None
        t0 = time.perf_counter()
        trainer.fit(model, train_dataloaders=loader)
        loop = time.perf_counter() - t0
        if io is not None:  # teardown closed the manager; its stats stay
            commit = io.stats.last_commit_seconds if io.stats else None
        rows.append(_row("Lightning", mode, model, list(seconds), commit, loop))
    return rows


def _row(framework, mode, model, seconds: list[float], commit, loop) -> dict:
    """The first save apart: it allocates what later saves reuse (host buffers)."""
    later = seconds[1:] or seconds
    return {
        "framework": framework,
        "checkpointing": {"own": "its own", "unbroken": "unbroken"}[mode],
        "state MiB": round(_state_mib(model), 1),
        "saves": len(seconds),
        "blocked ms, first save": round(seconds[0] * 1000, 1),
        "blocked ms, later (median)": round(statistics.median(later) * 1000, 1),
        "commit s": None if commit is None else round(commit, 2),
        "loop s": round(loop, 2),
    }


def _table(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[k] is None else str(r[k]) for k in head) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, 2 saves")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument(
        "--every", type=int, default=40,
        help="steps between saves: long enough here for the previous save to land",
    )  # fmt: skip
    a = p.parse_args()
    a.tokens, a.width, a.mlp_width = 64, 256, 1024
    if a.quick:
        a.saves, a.width, a.mlp_width = 2, 64, 256
    os.environ.setdefault("UNBROKEN_GOODPUT", "1")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ub-bench-integrations-") as tmp:
        work = Path(tmp)
        volume = _volume(work, 4 * a.every * a.saves + 4, a.tokens)
        warm = argparse.Namespace(**{**vars(a), "saves": 1})  # first-run costs, discarded
        bench_hf(work / "warm", volume, warm)
        bench_lightning(work / "warm", volume, warm)
        rows = bench_hf(work, volume, a) + bench_lightning(work, volume, a)
    load_after = os.getloadavg()
    print(_table(rows))
    print(
        f"\nload average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after {', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} cores; "
        f"torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
