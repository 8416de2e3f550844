"""What both examples share: process setup, arguments, and a record of the run.

The record is not needed to train: drop it (and the lines that call it) from your own
copy. The tests run an example once cleanly and once through crashes, then compare the
records bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Both examples' arguments (where data, checkpoints and staging live) and the
    example's own, already in ``parser``."""
    parser.add_argument(
        "--data", help="URL of the data directory (a path, s3://...); required, unless --make-data"
    )
    parser.add_argument(
        "--checkpoints",
        help="durable checkpoint URL (a path, s3://...); required, unless --make-data",
    )
    parser.add_argument(
        "--staging-dir",
        help="fast local disk for the local copy of each checkpoint "
        "(default: $UNBROKEN_STAGING_DIR or the temp dir)",
    )
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default=None,
        help="JSON given to the stores that are URLs (s3://...; a local path takes none), "
        'e.g. \'{"endpoint_url": "http://..."}\' (default: none)',
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="optimizer steps in all (default: %(default)s)"
    )
    parser.add_argument(
        "--every-steps", type=int, default=20, help="checkpoint cadence (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: 1 per core, <= 8)"
    )
    parser.add_argument(
        "--log-every", type=int, default=10, help="rank 0 prints the loss (default: %(default)s)"
    )
    parser.add_argument(
        "--result", default=None, help="rank 0 writes a JSON summary here (default: none)"
    )
    parser.add_argument(
        "--make-data", metavar="DIR", help="write a toy data set there, exit (default: train)"
    )
    args = parser.parse_args()
    if not args.make_data and not (args.data and args.checkpoints):
        parser.error("--data and --checkpoints are required (or --make-data DIR)")
    return args


def options_for(url: str, options: dict | None) -> dict | None:
    """``--storage-options`` for ``url``: a local path takes none (open_store refuses
    them), so S3 checkpoints beside local data need no second flag."""
    local = not ("://" in url or "::" in url) or url.startswith("file://")
    return None if local else options


def init_distributed() -> torch.device:
    """Join the job torchrun started: NCCL and one GPU per rank where there are GPUs,
    else gloo on CPU. Returns this rank's device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """Digest of this rank's bytes of ``tensors`` (an FSDP2 DTensor: its local shard)."""
    h = hashlib.sha256()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (moments, step counts), in a fixed order."""
    state = optim.state_dict()["state"]
    return [v for k in sorted(state) for _, v in sorted(state[k].items()) if torch.is_tensor(v)]


class RunRecord:
    """What the run trained on: each step's global batch (every rank's sample ids) is
    folded into a running digest kept in ``progress``, a plain value of the checkpointed
    state, so it survives restarts; the ids and losses of the steps this process ran."""

    def __init__(self, device: torch.device, resumed_from: int, restored: Any) -> None:
        self.device, self.resumed_from = device, resumed_from
        self.tier = restored.tier if restored is not None else None
        """Where the restore read from (``mgr.last_restore.tier``): staging, durable or
        staging+durable (this node's local files, the rest from the durable tier)."""
        where = f"the {self.tier} tier" if self.tier else "scratch"
        print(f"[rank {dist.get_rank()}] starting at step {resumed_from}, from {where}", flush=True)
        self.samples: dict[int, list[int]] = {}
        self.losses: dict[int, float] = {}

    def add(self, progress: dict, step: int, ids: torch.Tensor, loss: float) -> None:
        ids = ids.to(self.device, torch.int64)
        parts = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, ids)
        self.samples[step] = every = torch.cat(parts).tolist()
        self.losses[step] = loss
        h = hashlib.sha256(progress["samples_sha256"].encode())
        h.update(json.dumps([step, every]).encode())
        progress["samples_sha256"] = h.hexdigest()

    def write(
        self,
        path: str | None,
        *,
        progress: dict,
        weights: Iterable[torch.Tensor],
        optim: torch.optim.Optimizer,
        **extra: Any,
    ) -> None:
        """Rank 0 writes the record, every rank's digests gathered, as JSON to ``path``."""
        mine = {
            "weights_sha256": tensors_sha256(weights),
            "optimizer_sha256": tensors_sha256(optimizer_tensors(optim)),
            "restored_tier": self.tier,
        }
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if not path or dist.get_rank() != 0:
            return
        steps = max(self.samples, default=self.resumed_from)
        result = {
            "resumed_from": self.resumed_from, "steps": steps, "losses": self.losses,
            "samples": self.samples, "samples_sha256": progress["samples_sha256"],
            "ranks": ranks, **extra,
        }  # fmt: skip
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)  # a reader never sees half a result
