"""The rows of bench/checkpoint/saves.py: one way of saving per class, same small interface.

The training loop calls ``on_step(step)`` after every optimizer step and
``before_optim_step()`` before it (time spent in either is time the loop is blocked);
``drain()`` waits until every save so far is committed; ``restore_local()`` /
``restore_durable()`` load the newest committed checkpoint into the live state (None:
the row has no such tier). Every remote byte goes through the same emulated link.
"""

from __future__ import annotations

import glob
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from bench.storage.store_fs import PROTOCOL
from unbroken._util.direct_io import write_parts
from unbroken._util.host_memory import host_tensor
from unbroken._util.priority import lower_thread_priority


@dataclass
class RowContext:
    """What a row needs to know about the job and where to put its bytes."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    rank: int
    every: int
    """Save every this many steps."""
    row_dir: str
    """Local directory behind this row's emulated remote (its durable tier)."""
    work_dir: str
    """Scratch space on the local disk (staging tiers, spill files)."""
    remote_options: dict[str, Any]
    """Emulated remote profile options (``latency``, ``bandwidth``, ``link``)."""

    @property
    def store_url(self) -> str:
        return "emulated::" + self.row_dir

    def fs_options(self) -> dict[str, Any]:
        spill = os.path.join(self.work_dir, "spill")
        os.makedirs(spill, exist_ok=True)
        return {"store_url": self.store_url, "spill_dir": spill, **self.remote_options}


def local_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of this rank's share of the state: parameters, then optimizer state.

    Each parameter's optimizer state in the order of its names: a restore may put the
    same entries back in another order (set_optimizer_state_dict on FSDP2 does), and the
    byte checks compare these lists by position.
    """
    out = []
    for p in model.parameters():
        out.append(p.to_local() if hasattr(p, "to_local") else p)
    for p in model.parameters():
        state = optim.state.get(p, {})
        for _, v in sorted(state.items(), key=lambda kv: str(kv[0])):
            if isinstance(v, torch.Tensor):
                out.append(v.to_local() if hasattr(v, "to_local") else v)
    return [t.detach() for t in out]


def sharded_state(ctx: RowContext) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(ctx.model),
        "optim": get_optimizer_state_dict(ctx.model, ctx.optim),
    }


def load_sharded_state(ctx: RowContext, sd: dict[str, Any]) -> None:
    set_model_state_dict(ctx.model, sd["model"])
    set_optimizer_state_dict(ctx.model, ctx.optim, sd["optim"])


class Row:
    """Interface and the shared bookkeeping: which saves are pending, which to prune."""

    key = ""
    title = ""

    def __init__(self, ctx: RowContext) -> None:
        self.ctx = ctx
        self.saved_steps: list[int] = []

    def is_save_step(self, step: int) -> bool:
        return step > 0 and step % self.ctx.every == 0

    def on_step(self, step: int) -> None:
        if self.is_save_step(step):
            self.save(step)

    def save(self, step: int) -> None:
        raise NotImplementedError

    def before_optim_step(self) -> None:
        """Wait for anything that must finish before the optimizer changes the state."""

    def drain(self) -> None:
        """Block until every save so far is committed."""

    def prepare_restore(self) -> None:
        """Untimed set-up before the restores (e.g. a fresh reader)."""

    def restore_local(self) -> bool | None:
        return None

    def restore_durable(self) -> bool | None:
        return None

    def close(self) -> None:
        self.drain()

    def notes(self) -> dict[str, Any]:
        """Row-specific facts for the report (e.g. saves the library skipped)."""
        return {}

    @property
    def last_commit_seconds(self) -> float | None:
        """From the newest save call until it was whole in every tier; None: not known."""
        return None

    def _prune(self, keep: int = 2) -> None:
        """Keep the durable tier small: rank 0 drops all but the newest ``keep`` saves."""
        while len(self.saved_steps) > keep:
            old = self.saved_steps.pop(0)
            if self.ctx.rank == 0:
                for path in glob.glob(os.path.join(self.ctx.row_dir, f"step-{old:09d}*")):
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)

    def _url(self, step: int, suffix: str = "") -> str:
        return f"{PROTOCOL}://step-{step:09d}{suffix}"


class NoSaves(Row):
    key, title = "baseline", "no saves"

    def on_step(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass


class NoSavesAgain(NoSaves):
    """The baseline once more, last: how far two runs without saves differ is the noise."""

    key, title = "baseline_end", "no saves (again)"


class MemcpyFloor(Row):
    """A copy of the state into preallocated buffers: the least any snapshot can cost."""

    key, title = "floor", "floor (memcpy)"

    def __init__(self, ctx: RowContext) -> None:
        super().__init__(ctx)
        self.src = local_tensors(ctx.model, ctx.optim)
        self.buffers = self._new_buffers()

    def _new_buffers(self) -> list[torch.Tensor]:
        return [torch.empty_like(t) for t in self.src]

    def save(self, step: int) -> None:
        for b, t in zip(self.buffers, self.src):
            b.copy_(t)
        self.saved_steps.append(step)

    def restore_local(self) -> bool:
        for b, t in zip(self.buffers, self.src):
            t.copy_(b)
        return True

    @property
    def last_commit_seconds(self) -> float | None:
        return 0.0  # whole when save() returns


class TwoTierFloor(MemcpyFloor):
    """The floor plus the bytes every two-tier save here must put on disk: the buffers
    written once to a local file and once to the remote's directory (this machine's disk
    too), both with O_DIRECT, on one background thread at the checkpoint worker's lowered
    priority. No checksums, no link, no commit: what any library's save to both tiers
    costs at least on this machine, to hold the unbroken row against."""

    key, title = "floor_2tier", "floor + 2 disk writes"

    def __init__(self, ctx: RowContext) -> None:
        self.maps: list[Any] = []
        super().__init__(ctx)
        self.local_dir = os.path.join(ctx.work_dir, "floor-2tier")
        os.makedirs(self.local_dir, exist_ok=True)
        self.writing: threading.Thread | None = None
        self.failure: list[BaseException] = []
        self.save_began = 0.0
        self.written_at = 0.0

    def _new_buffers(self) -> list[torch.Tensor]:
        """The memory unbroken's staging buffers use by default (page-aligned, huge pages
        advised): O_DIRECT writes them in place."""
        buffers = [host_tensor(tuple(t.shape), t.dtype) for t in self.src]
        self.maps = [memoryview(b.reshape(-1).view(torch.uint8).numpy()) for b in buffers]
        return buffers

    def save(self, step: int) -> None:
        self.drain()  # a save in flight is waited for, as in every other row
        self.save_began, self.written_at = time.perf_counter(), 0.0
        super().save(step)
        name = f"step-{step:09d}-rank{self.ctx.rank}.bin"
        paths = [os.path.join(self.local_dir, name), os.path.join(self.ctx.row_dir, name)]
        self.writing = threading.Thread(target=self._write, args=(paths,), daemon=True)
        self.writing.start()

    def _write(self, paths: list[str]) -> None:
        lower_thread_priority()
        try:
            for path in paths:
                write_parts(self.maps, path)
        except BaseException as e:  # raised again on the training thread by drain()
            self.failure.append(e)
        self.written_at = time.perf_counter()

    def drain(self) -> None:
        if self.writing is not None:
            self.writing.join()
            self.writing = None
        if self.failure:
            raise RuntimeError("floor + 2 disk writes: a write failed") from self.failure.pop()
        self._prune()
        mine = sorted(glob.glob(os.path.join(self.local_dir, f"*-rank{self.ctx.rank}.bin")))
        for old in mine[:-1]:  # the newest local file stays, as a staging tier's would
            os.unlink(old)

    def restore_local(self) -> bool | None:
        return None  # the files are a cost, not a format anything restores from

    @property
    def last_commit_seconds(self) -> float | None:
        return self.written_at - self.save_began if self.written_at else None


class TorchSaveRank0(Row):
    """Gather the full state on rank 0 and ``torch.save`` it to the remote; others wait."""

    key, title = "torch_save", "torch.save rank 0"
    FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save(self, step: int) -> None:
        msd, osd = get_state_dict(self.ctx.model, self.ctx.optim, options=self.FULL)
        if self.ctx.rank == 0:
            self._write_full(step, {"model": msd, "optim": osd})
        del msd, osd
        dist.barrier()
        self.saved_steps.append(step)
        self._prune()

    def _write_full(self, step: int, full: dict[str, Any]) -> None:
        """Rank 0: put the gathered state where ``_read_full`` finds it."""
        fs, path = url_to_fs(self._url(step, ".pt"), **self.ctx.fs_options())
        with fs.open(path, "wb") as f:  # a failed torch.save uploads nothing
            torch.save(full, f)

    def _read_full(self, step: int) -> dict[str, Any]:
        fs, path = url_to_fs(self._url(step, ".pt"), **self.ctx.fs_options())
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)

    def restore_durable(self) -> bool:
        msd: dict = {}
        osd: dict = {}
        if self.ctx.rank == 0:
            full = self._read_full(self.saved_steps[-1])
            msd, osd = full["model"], full["optim"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # Separate calls: set_state_dict treats an empty model dict (ranks > 0) as
        # "optimizer only" and skips the model's broadcast, which hangs rank 0.
        set_model_state_dict(self.ctx.model, msd, options=options)
        set_optimizer_state_dict(self.ctx.model, self.ctx.optim, osd, options=options)
        return True


class DcpSave(Row):
    """``dcp.save`` with ``FsspecWriter`` defaults: every rank writes its shard, blocking."""

    key, title = "dcp_save", "dcp.save"

    def writer(self, step: int) -> FsspecWriter:
        return FsspecWriter(self._url(step), **self.ctx.fs_options())

    def save(self, step: int) -> None:
        dcp.save(sharded_state(self.ctx), storage_writer=self.writer(step))
        self.saved_steps.append(step)
        self._prune()

    def restore_durable(self) -> bool:
        sd = sharded_state(self.ctx)
        reader = FsspecReader(self._url(self.saved_steps[-1]), **self.ctx.fs_options())
        dcp.load(sd, storage_reader=reader)
        load_sharded_state(self.ctx, sd)
        return True


class DcpAsyncDefault(DcpSave):
    """``dcp.async_save`` with its defaults: a fresh CPU copy per save, a writer thread.

    The only non-default argument is a dedicated gloo group: the writer thread's
    collectives on the default group would race the training loop's (torchtitan does
    the same).
    """

    key, title = "dcp_async_default", "dcp.async_save default"

    def __init__(self, ctx: RowContext) -> None:
        super().__init__(ctx)
        self.group = dist.new_group(backend="gloo")
        self.pending: Future | None = None

    def _async_kwargs(self) -> dict[str, Any]:
        return {}

    def save(self, step: int) -> None:
        self.drain()  # one save in flight at a time, as DCP's docs advise
        result = dcp.async_save(
            sharded_state(self.ctx),
            storage_writer=self.writer(step),
            process_group=self.group,
            **self._async_kwargs(),
        )
        self._started(result)
        self.saved_steps.append(step)

    def _started(self, result: Any) -> None:
        self.pending = result

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            self._prune()


class DcpAsyncBest(DcpAsyncDefault):
    """``dcp.async_save`` with the fastest options that work on CPU with torch 2.13.

    One long-lived ``DefaultStager`` (shared-memory buffers cached per source storage,
    reused every save; copy on a background thread), and the persistent checkpoint
    process. Pinned memory and non-blocking copies need an accelerator; the default
    ``StagingOptions`` and ``cache_staged_state_dict=True`` fail here.
    """

    key, title = "dcp_async_best", "dcp.async_save best"
    OPTIONS = {
        "use_pinned_memory": False,
        "use_shared_memory": True,
        "use_async_staging": True,
        "use_non_blocking_copy": False,
    }

    def __init__(self, ctx: RowContext) -> None:
        super().__init__(ctx)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.stager = DefaultStager(StagingOptions(**self.OPTIONS))
        self.kind = AsyncCheckpointerType.PROCESS
        self.staging: Future | None = None

    def _async_kwargs(self) -> dict[str, Any]:
        return {"async_checkpointer_type": self.kind, "async_stager": self.stager}

    def _started(self, result: Any) -> None:
        self.staging = result.staging_completion
        self.pending = result.upload_completion

    def before_optim_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_optim_step()
        super().drain()

    def close(self) -> None:
        self.drain()
        self.stager.close()


class Unbroken(Row):
    """``unbroken.CheckpointManager``: async, tiered (local staging dir, then the remote)."""

    key, title = "unbroken", "unbroken"

    def __init__(self, ctx: RowContext) -> None:
        super().__init__(ctx)
        import unbroken as ub

        self.ub = ub
        self.state = {"model": ctx.model, "optim": ctx.optim}
        self.staging_dir = os.path.join(ctx.work_dir, "unbroken-staging")
        self.mgr = self._manager(self.staging_dir)
        self.fresh_mgr: Any = None

    def _manager(self, staging_dir: str) -> Any:
        args = (self.ctx.store_url,)
        kwargs = dict(
            staging_dir=staging_dir,
            every_steps=self.ctx.every,
            keep_last=2,
            async_save=True,
            storage_options=dict(self.ctx.remote_options),
            **self._manager_options(),
        )
        try:
            # A due save waits for the one in flight, as every other row does, instead of
            # being skipped (which would make the row look cheaper by saving less).
            return self.ub.CheckpointManager(*args, when_busy="wait", **kwargs)
        except TypeError:
            return self.ub.CheckpointManager(*args, **kwargs)

    def _manager_options(self) -> dict[str, Any]:
        """Options this row gives the manager beyond the ones every unbroken row shares."""
        return {}

    def notes(self) -> dict[str, Any]:
        stats = getattr(self.mgr, "stats", None)
        if stats is None:
            return {}
        started = max(1, getattr(stats, "started", 0))
        return {
            "skipped_saves": getattr(stats, "skipped_busy", 0),
            "own_blocked_s": getattr(stats, "seconds_blocked", 0.0) / started,
            "own_last_commit_s": getattr(stats, "last_commit_seconds", None),
        }

    def on_step(self, step: int) -> None:
        self.mgr.maybe_save(step, self.state)
        if self.is_save_step(step):
            self.saved_steps.append(step)

    def save(self, step: int) -> None:
        self.mgr.save(step, self.state)
        self.saved_steps.append(step)

    @property
    def last_commit_seconds(self) -> float | None:
        return self.mgr.stats.last_commit_seconds

    def drain(self) -> None:
        self.mgr.wait()

    def _restore(self, mgr: Any) -> bool:
        step = mgr.restore(self.state)
        if step != self.saved_steps[-1]:
            raise RuntimeError(f"unbroken restored step {step}, expected {self.saved_steps[-1]}")
        return True

    def restore_local(self) -> bool:
        return self._restore(self.mgr)

    def prepare_restore(self) -> None:
        """A second manager with an empty staging tier: its restore must use the remote."""
        # The same name on every rank: one node, one staging tier.
        fresh = os.path.join(self.ctx.work_dir, f"unbroken-empty-staging-{self.saved_steps[-1]}")
        self.fresh_mgr = self._manager(fresh)

    def restore_durable(self) -> bool:
        return self._restore(self.fresh_mgr)

    def local_tier_files(self) -> list[str]:
        """The newest checkpoint's files in the staging tier (to measure its bandwidth)."""
        dirs = sorted(glob.glob(os.path.join(self.staging_dir, "**", "step-*"), recursive=True))
        dirs = [d for d in dirs if os.path.isdir(d)]
        if not dirs:
            return []
        newest = max(dirs, key=lambda d: os.path.basename(d))
        return [
            p for p in glob.glob(os.path.join(newest, "**"), recursive=True) if os.path.isfile(p)
        ]

    def close(self) -> None:
        self.mgr.close()
        if self.fresh_mgr is not None:
            self.fresh_mgr.close()


class UnbrokenSharedStaging(Unbroken):
    """unbroken with its staging buffers in shared memory (4 KiB pages here) instead of
    private huge-page memory: the pairs probe's ``--also`` side of that choice."""

    key, title = "unbroken_shared", "unbroken, shared-memory staging"

    def _manager_options(self) -> dict[str, Any]:
        return {"staging_shared_memory": True}


ROWS: list[type[Row]] = [
    NoSaves,
    MemcpyFloor,
    TwoTierFloor,
    TorchSaveRank0,
    DcpSave,
    DcpAsyncDefault,
    DcpAsyncBest,
    Unbroken,
    NoSavesAgain,
]
BASELINES = ("baseline", "baseline_end")
