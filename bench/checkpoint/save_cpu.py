"""CPU time one checkpoint save costs, per GiB, measured on a quiet machine.

Why a second checkpoint benchmark: where every core trains (as on the 2-core machines
this project is tested on), what a background save costs the training loop is made of
the CPU time it takes from it. bench/checkpoint/saves.py measures that cost as time lost
(wall time), through a few per cent of run-to-run drift; a change that saves 0.1 s of CPU per
save is invisible there. This one measures the CPU itself, in one process, with nothing
training, so such a change shows, and says how far a save is from the least any copy
of the state costs.

Rows (the same state: ``--gib`` of fp32 tensors shaped like one rank's share of the
checkpoint benchmark's model and Adam state):

- ``memcpy floor``: copy into preallocated buffers, what any snapshot costs;
- ``torch.save``: to a new local file (through the page cache);
- ``dcp.save``: ``FileSystemWriter`` into a new local directory;
- ``unbroken``: ``CheckpointManager.save`` then ``wait()``: staging copy, the local tier
  (O_DIRECT, crc32c), upload to the emulated remote (standard profile) and commit.

``--s3``: the same against the real S3 server on loopback (SeaweedFS, started here), the
rows the memcpy floor, ``raw put`` (the state's bytes, one file in shared memory,
uploaded as one object by the native store: what any client's upload costs), unbroken
with its save helper, with the uploads on threads (``save_helper=False``), and with the
node's copy on the disk tier (``memory_tier=False``: no helper, the upload leaves from
the host buffers as the shard is written), and, where s3torchconnector is installed,
``dcp s3connector``: ``dcp.save`` through its writer, in this process.
On a machine whose cores also run the server, a save's cost to training is mostly the
server's CPU: the column ``server`` says how much of the machine's it is, and
``helper`` what the save helper process took.

Columns are medians over ``--saves`` saves after one warm-up: CPU seconds per GiB of
the whole machine (``/proc/stat``, kernel threads included, less what the machine was
busy with before the row), that as a multiple of the memcpy floor's, and wall seconds;
``--all-columns`` adds this process's user and system CPU per GiB. The last line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
import torch.distributed.checkpoint as dcp

import unbroken as ub
from bench.checkpoint.measure import cpu_clocks
from bench.common.proc_cpu import process_cpu_seconds
from bench.common.s3remote import S3Remote
from unbroken.storage.link import discard_link

GiB = 1 << 30


@dataclass
class Sample:
    """One save's cost."""

    user: float
    system: float
    machine: float
    wall: float
    server: float = 0.0
    """CPU seconds of the S3 server (``--s3``)."""
    helper: float = 0.0
    """CPU seconds of this process's save helpers."""


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy since boot (all cores)."""
    return cpu_clocks().machine_s


def idle_rate(seconds: float = 1.0) -> float:
    """Cores the machine keeps busy with nothing of ours running."""
    before = machine_busy()
    time.sleep(seconds)
    return (machine_busy() - before) / seconds


def helpers_cpu() -> float:
    """CPU seconds so far of this process's live save helpers (children running
    ``unbroken.checkpoint.save_helper``; not the server, nor any other child)."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "unbroken.checkpoint.save_helper" in " ".join(child.cmdline()):
                total += process_cpu_seconds(child.pid)
        except (psutil.Error, OSError):
            pass
    return total


def measure(
    save: Callable[[int], None], index: int, background: float, remote: S3Remote | None = None
) -> Sample:
    s0 = remote.server_cpu_seconds() if remote else 0.0
    c0 = helpers_cpu()
    r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), machine_busy(), time.perf_counter()
    save(index)
    wall = time.perf_counter() - t0
    r1, m1 = resource.getrusage(resource.RUSAGE_SELF), machine_busy()
    return Sample(
        user=r1.ru_utime - r0.ru_utime,
        system=r1.ru_stime - r0.ru_stime,
        machine=max(0.0, m1 - m0 - background * wall),
        wall=wall,
        server=(remote.server_cpu_seconds() - s0) if remote else 0.0,
        helper=max(0.0, helpers_cpu() - c0),
    )


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """Tensors of 32 MiB (a 4096 x 4096 layer's half, and its two Adam moments)."""
    state: dict[str, torch.Tensor] = {}
    per_tensor = 2048 * 4096
    count = max(1, round(gib * GiB / 4 / per_tensor))
    rows = max(1, int(gib * GiB / 4 / count / 4096))
    for i in range(count):
        state[f"t{i:03d}"] = torch.rand(rows, 4096)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def rows(
    state: dict[str, torch.Tensor], work: str
) -> tuple[dict[str, Callable[[int], None]], Callable[[], object]]:
    """Each row's function, which does save number ``i`` and returns once it is complete;
    and what to call when done."""
    floor = {k: torch.empty_like(t) for k, t in state.items()}

    def memcpy(_i: int) -> None:
        for k, t in state.items():
            floor[k].copy_(t)

    def torch_save(i: int) -> None:
        path = os.path.join(work, f"torch-{i}.pt")
        torch.save(state, path)
        os.unlink(path)

    def dcp_save(i: int) -> None:
        path = os.path.join(work, f"dcp-{i}")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        shutil.rmtree(path)

    link = f"save-cpu-{os.getpid()}"
    mgr = ub.CheckpointManager(
        f"emulated::{os.path.join(work, 'remote')}",
        staging_dir=os.path.join(work, "staging"),
        every_steps=None,
        keep_last=1,
        storage_options={"link": link},
    )

    def unbroken_save(i: int) -> None:
        mgr.save(i + 1, state)
        mgr.wait()

    return {
        "memcpy floor": memcpy,
        "torch.save": torch_save,
        "dcp.save": dcp_save,
        "unbroken": unbroken_save,
    }, lambda: (mgr.close(), discard_link(link))


UNBROKEN_S3_ROWS = [
    ("unbroken", True, None),  # the defaults: the memory tier, the save helper
    ("unbroken threads", False, None),
    ("unbroken disk", True, False),  # memory_tier=False: the disk tier, no helper
]
"""``--s3``'s unbroken rows: (name, save_helper, memory_tier)."""


def s3_rows(
    state: dict[str, torch.Tensor], work: str, remote: S3Remote
) -> tuple[dict[str, Callable[[int], None]], Callable[[], object]]:
    """``rows`` against the real S3 server: the floor, a raw put, unbroken two ways."""
    floor = {k: torch.empty_like(t) for k, t in state.items()}

    def memcpy(_i: int) -> None:
        for k, t in state.items():
            floor[k].copy_(t)

    raw_file = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"raw-{os.getpid()}")
    with open(raw_file, "wb") as f:
        for t in state.values():
            f.write(memoryview(t.numpy()).cast("B"))
    store = ub.open_store(f"s3://{remote.new_root()}", **remote.storage_options)

    def raw_put(i: int) -> None:
        store.upload(raw_file, f"raw/{i}")

    current: dict[str, ub.CheckpointManager] = {}
    """The running row's manager: made at its warm-up save, once the row before has closed
    its own (and with it its save helper, which would count in this row's CPU)."""

    def saving(n: int, name: str, helper: bool, memory: bool | None) -> Callable[[int], None]:
        def save(i: int) -> None:
            if name not in current:
                for other in current.values():
                    other.close()
                current.clear()
                current[name] = ub.CheckpointManager(
                    f"s3://{remote.new_root()}",
                    staging_dir=os.path.join(work, f"staging-{n}"),
                    every_steps=None,
                    keep_last=1,
                    storage_options=remote.storage_options,
                    save_helper=helper,
                    memory_tier=memory,
                )
            current[name].save(i + 1, state)
            current[name].wait()

        return save

    def close() -> None:
        for mgr in current.values():
            mgr.close()
        os.unlink(raw_file)

    funcs = {"memcpy floor": memcpy, "raw put": raw_put}
    funcs.update({row[0]: saving(n, *row) for n, row in enumerate(UNBROKEN_S3_ROWS)})
    if importlib.util.find_spec("s3torchconnector") is not None:
        funcs["dcp s3connector"] = dcp_s3_save(state, remote)
    return funcs, close


def dcp_s3_save(state: dict[str, torch.Tensor], remote: S3Remote) -> Callable[[int], None]:
    """``dcp.save`` through s3torchconnector's writer, in this process: what the same
    bytes cost the server (and its client) under the request pattern of the peer that
    leads the one-rank points of the scaling grid."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    from bench.checkpoint.s3rows import REGION, aws_env
    from tests.s3server import CREDENTIALS

    os.environ.update(aws_env(remote.endpoint_url, CREDENTIALS["key"], CREDENTIALS["secret"]))
    root = remote.new_root()

    def save(i: int) -> None:
        writer = S3StorageWriter(
            REGION, f"s3://{root}/dcp-{i}", s3client_config=S3ClientConfig(force_path_style=True)
        )
        dcp.save(state, storage_writer=writer, no_dist=True)

    return save


def table(results: dict[str, dict[str, float]], all_columns: bool = False, s3: bool = False) -> str:
    """CPU per GiB saved, beside the memcpy floor's; user and system split with all_columns;
    with ``s3``, the server's share and the save helper's."""
    floor = results["memcpy floor"]["machine"]
    head = f"{'row':<16} {'CPU s per GiB':>13} {'x memcpy floor':>14} {'wall s':>8}"
    if s3:
        head += f" {'of it: server':>13} {'helper':>7}"
    if all_columns:
        head += f" {'user s/GiB':>10} {'system s/GiB':>12}"
    lines = [head]
    for name, r in results.items():
        times = f"{r['machine'] / floor:>13.1f}x" if floor else f"{'n/a':>14}"
        line = f"{name:<16} {r['machine']:>13.3f} {times} {r['wall']:>8.2f}"
        if s3:
            line += f" {r['server']:>13.3f} {r['helper']:>7.3f}"
        if all_columns:
            line += f" {r['user']:>10.3f} {r['system']:>12.3f}"
        lines.append(line)
    lines.append("CPU: the whole machine's, beyond its idle rate, while the save ran")
    return "\n".join(lines)


def _key(row: str) -> str:
    return row.replace(" ", "_").replace(".", "_")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.5, help="GiB of state (1.5; quick 0.06)")
    p.add_argument("--saves", type=int, default=3, help="measured saves per row (3)")
    p.add_argument("--quick", action="store_true", help="small state, one save: seconds")
    p.add_argument("--work-dir", default=None, help="where the files go (a temp dir)")
    p.add_argument("--all-columns", action="store_true", help="also user and system CPU")
    p.add_argument("--s3", action="store_true", help="against the real S3 server on loopback")
    a = p.parse_args(argv)
    gib = 0.0625 if a.quick and a.gib == 1.5 else a.gib
    saves = 1 if a.quick else a.saves
    if gib <= 0 or saves < 1:
        p.error("--gib must be positive and --saves at least 1")
    torch.set_num_threads(1)  # as in a rank under torchrun
    state = make_state(gib)
    size_gib = state_bytes(state) / GiB
    work = tempfile.mkdtemp(prefix="unbroken-save-cpu-", dir=a.work_dir)
    results: dict[str, dict[str, float]] = {}
    remote = S3Remote.profile("loopback") if a.s3 else None
    try:
        funcs, close = s3_rows(state, work, remote) if remote else rows(state, work)
        try:
            for name, save in funcs.items():
                save(0)  # warm-up: buffers, first-use costs
                background = idle_rate()
                samples = [measure(save, i + 1, background, remote) for i in range(saves)]
                results[name] = {
                    f: statistics.median(getattr(s, f) for s in samples) / size_gib
                    if f != "wall"
                    else statistics.median(s.wall for s in samples)
                    for f in ("user", "system", "machine", "wall", "server", "helper")
                }
        finally:
            close()
    finally:
        if remote:
            remote.close()
        shutil.rmtree(work, ignore_errors=True)
    where = f", durable tier {remote.describe()}" if remote else ""
    print(f"state: {size_gib:.2f} GiB in {len(state)} tensors; medians of {saves} save(s){where}")
    print(table(results, a.all_columns, s3=remote is not None))
    floor = results["memcpy floor"]["machine"]
    summary = {
        "gib": round(size_gib, 3),
        "saves": saves,
        **{f"{_key(k)}_cpu_s_per_gib": round(v["machine"], 4) for k, v in results.items()},
        **{
            f"{_key(k)}_process_cpu_s_per_gib": round(v["user"] + v["system"], 4)
            for k, v in results.items()
        },
        "unbroken_over_floor": round(results["unbroken"]["machine"] / floor, 2) if floor else None,
    }
    if remote:
        summary.update({f"{_key(k)}_server_cpu_s_per_gib": round(v["server"], 4)
                        for k, v in results.items()})  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
