"""Train a small transformer language model with FSDP2; it survives any crash by itself.

    python examples/train_lm.py --make-data /data/tokens      # a toy token data set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/train_lm.py --data /data/tokens --checkpoints s3://bucket/lm-1 \\
        --staging-dir /local/nvme/staging --steps 200

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` keeps torchrun's restarts from hanging (see the
README). Runs unchanged on CPUs (gloo) and on GPUs (NCCL, one GPU per rank), in bf16
autocast where the GPU supports it. The data is a directory of small files of uint16
tokens, one training sequence per file. Parameters and optimizer state are sharded
(``fully_shard``); each rank saves its shards, and a restore reshards to any world size.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken as ub
from common import RunRecord, init_distributed, options_for, parse_args

VOCAB, CONTEXT = 256, 64  # token ids < 256; each file holds CONTEXT + 1 tokens


def decode(data: bytes, path: str) -> tuple[torch.Tensor, int]:
    """A file of little-endian uint16 tokens -> (tokens, sample id from the file name)."""
    tokens = torch.from_numpy(np.frombuffer(data, dtype="<u2").astype(np.int64))
    return tokens, int(os.path.splitext(os.path.basename(path))[0])


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, with dropout on both residual branches."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 128, layers: int = 2, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Parameter(torch.zeros(CONTEXT, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens) + self.pos[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def warmup_cosine(warmup: int, total: int):
    """LR factor: linear warm-up over ``warmup`` steps, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per rank (default: %(default)s)"
    )
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 autocast on GPUs that support it, else fp32 "
                             "(default: %(default)s)")  # fmt: skip
    args = parse_args(parser)
    if args.make_data:
        return make_data(args.make_data)

    device = init_distributed()  # NCCL and a GPU per rank where there are GPUs, else gloo
    rank, cuda = dist.get_rank(), device.type == "cuda"
    bf16 = args.precision == "bf16" or (
        args.precision == "auto" and cuda and torch.cuda.is_bf16_supported()
    )  # CPUs run bf16 autocast too (--precision bf16), most of them slower than fp32
    torch.manual_seed(0)  # the same initial weights on every rank

    # FSDP2: shard each block, then the rest; every rank holds 1/world of each tensor.
    model = TinyLM().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(args.steps // 10, args.steps))
    dataset = ub.VolumeDataset(
        args.data,
        decode=decode,
        seed=1,
        storage_options=options_for(args.data, args.storage_options),
    )
    loader = ub.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)

    # Each rank saves its own shards (and reads back whatever shards a new world needs).
    state = {
        "model": model, "optim": optim, "sched": sched, "loader": loader,
        "progress": {"samples_sha256": ""},  # for the tests: what was trained on
    }  # fmt: skip
    mgr = ub.CheckpointManager(
        args.checkpoints,
        staging_dir=args.staging_dir,
        every_steps=args.every_steps,
        keep_last=2,
        storage_options=options_for(args.checkpoints, args.storage_options),
    )
    step = mgr.restore(state) or 0
    record = RunRecord(device, step, mgr.last_restore)  # says where it started from
    while step < args.steps:
        for tokens, ids in loader:
            tokens = tokens.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()  # warm-up, then cosine: the scheduler's position is checkpointed
            step += 1
            record.add(state["progress"], step, ids, loss.item())
            mgr.maybe_save(step, state)
            if rank == 0 and step % args.log_every == 0:
                print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    mgr.save(step, state)
    mgr.close()

    record.write(
        args.result, progress=state["progress"], weights=model.state_dict().values(),
        optim=optim, bf16=bf16,
    )  # fmt: skip
    print(f"[rank {rank}] done at step {step}", flush=True)
    dist.destroy_process_group()


def make_data(root: str, files: int = 2048) -> None:
    """Sequences of a random sparse Markov chain over the vocabulary (learnable)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 4))  # 4 likely next tokens each
    for i in range(files):
        seq = [int(rng.integers(VOCAB))]
        for _ in range(CONTEXT):
            seq.append(int(successors[seq[-1], rng.integers(4)]))
        np.asarray(seq, dtype="<u2").tofile(os.path.join(root, f"{i:06d}.bin"))
    print(f"wrote {files} token files of {CONTEXT + 1} tokens to {root}")


if __name__ == "__main__":
    main()
