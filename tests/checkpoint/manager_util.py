"""Small models and state helpers shared by the manager tests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn


def make_state(seed: int = 0, *, lr: float = 0.05, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 3))
    model.to(device)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "ema": torch.zeros(4, device=device),
        "epoch": 0,
        "meta": {"name": "run", "tags": [1, 2]},
    }


def train(state: dict, steps: range) -> None:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    device = next(model.parameters()).device
    for step in steps:
        x = torch.randn(8, 6, device=device)
        loss = model(nn.functional.dropout(x, 0.1)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        state["ema"].mul_(0.5).add_(step)
        state["epoch"] = step // 3


def snapshot(state: dict) -> dict:
    """Every value of ``state`` as plain CPU tensors/values, for exact comparison."""
    out = {f"model.{k}": v.cpu().clone() for k, v in state["model"].state_dict().items()}
    osd = state["optim"].state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = torch.as_tensor(v).cpu().clone()
    out["optim.lr"] = [g["lr"] for g in osd["param_groups"]]
    out["sched"] = state["sched"].state_dict()
    out["ema"] = state["ema"].cpu().clone()
    out["epoch"] = state["epoch"]
    out["meta"] = state["meta"]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], (k, a[k], b[k])


def rng_draws(*, cuda: bool = False) -> list[float]:
    """A draw from every generator a job's restore must bring back; ``cuda``: CUDA's too
    (captured only in a process that has initialized CUDA, as a job on the GPU has)."""
    draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    if cuda:
        draws.append(float(torch.rand((), device="cuda")))
    return draws


def flip_payload_byte(step_path, key: str = "model.0.weight") -> None:
    """Flip one byte inside the saved bytes of ``key`` (not in padding or headers)."""
    import json
    from pathlib import Path

    step_path = Path(step_path)
    doc = json.loads((step_path / "metadata.json").read_text())
    locs = [d for d in doc["storage_data"] if d["fqn"] == key]
    assert locs, f"{key} not in {step_path}/metadata.json"
    shard = step_path / locs[0]["file"]
    start, length = locs[0]["payload"]
    data = bytearray(shard.read_bytes())
    data[start + length // 2] ^= 0x5A
    shard.write_bytes(bytes(data))


def plant_value(step_path, fqn: str, payload: bytes) -> None:
    """An attacker with write access to a committed step: append ``payload`` to the shard
    holding ``fqn``, point ``fqn`` at it, and fix metadata.json and manifest.json so that
    every size and checksum agrees (the manifest's own checksum too)."""
    import json
    from pathlib import Path

    from unbroken.checkpoint.format.manifest import crc32c_bytes

    step_path = Path(step_path)
    doc = json.loads((step_path / "metadata.json").read_bytes())
    entry = next(e for e in doc["storage_data"] if e["fqn"] == fqn)
    shard = step_path / entry["file"]
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    span = [offset, len(payload)]
    entry.update(record=span, payload=span, crc32c=crc32c_bytes(payload))
    (step_path / "metadata.json").write_bytes(json.dumps(doc).encode())
    reseal(step_path, {entry["file"], "metadata.json"})


def reseal(step_path, changed=(), edit=None) -> None:
    """Make ``manifest.json`` of ``step_path`` agree with files rewritten in place
    (``changed``: their names) and with ``edit(doc)`` applied to it, its own checksum
    recomputed: what a writer with a bug, or with write access, could leave committed."""
    import json
    from pathlib import Path

    from unbroken.checkpoint.format.manifest import SELF_CHECKSUM, crc32c_file, manifest_checksum

    step_path = Path(step_path)
    manifest = json.loads((step_path / "manifest.json").read_bytes())
    for rec in manifest["files"]:
        if rec["name"] in changed:
            path = step_path / rec["name"]
            rec.update(size=path.stat().st_size, crc32c=crc32c_file(path))
    if edit is not None:
        edit(manifest)
    manifest[SELF_CHECKSUM] = manifest_checksum(manifest)
    (step_path / "manifest.json").write_bytes(json.dumps(manifest).encode())


def host_rss() -> int:
    """Bytes of anonymous and shared memory this process has resident: where the staging
    pool's buffers live (private mappings by default, segments with shared memory)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem"):
                fields[name] = int(value.split()[0]) * 1024
    if len(fields) < 2:
        pytest.skip("no RssAnon/RssShmem in /proc/self/status")
    return sum(fields.values())
