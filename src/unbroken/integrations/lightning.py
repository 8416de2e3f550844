"""PyTorch Lightning through unbroken: a ``CheckpointIO`` plugin and the callback it needs.

```python
class Data(L.LightningDataModule):
    def train_dataloader(self):  # made in fit, once DDP is up: each rank its own samples
        return ub.DataLoader(ub.VolumeDataset(...), batch_size=4)

ckpt = UnbrokenCheckpointIO("s3://bucket/run", every_steps=50)
trainer = L.Trainer(..., plugins=[ckpt], callbacks=[ckpt.callback])
trainer.fit(model, datamodule=Data(), ckpt_path="last")
```

The plugin writes Lightning's checkpoint dict through a :class:`CheckpointManager`
(asynchronous, tiered, committed, recovered, resharded): tensors as tensors, everything
else as JSON (:mod:`unbroken.integrations.checkpoint_dict`); what would need pickle is
refused by path, and nothing is unpickled on load. Lightning's checkpoint folders are
not written.

Why a callback too: Lightning calls a plugin only to save and load, and under DDP on
rank 0 alone, while a save through the manager is collective and the manager's cadence
and preemption act in ``maybe_save``. :class:`UnbrokenCallback` (made by the plugin)
creates the manager on every rank once the process group is up, has the strategy hand
every rank's checkpoint to the plugin, calls ``maybe_save`` after each optimizer step
(the checkpoint dict is built only on a due step; never between the micro-batches of a
gradient accumulation, which a resume could not take up), hands SIGTERM to the manager
instead of Lightning's own handler (which stops the loop without a save), re-applies
the restored RNG at the first batch (Lightning runs code between its load and that
batch), and makes ``ckpt_path="last"`` (Lightning's default when fitting with it) find
the newest committed step.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.callbacks.callback import Callback
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "unbroken.integrations.lightning needs lightning: pip install 'unbroken[lightning]'"
    ) from e

import torch

from unbroken.checkpoint import json_values
from unbroken.checkpoint.catalog import list_checkpoints
from unbroken.checkpoint.config import check_option_names
from unbroken.checkpoint.errors import NoCheckpointError
from unbroken.checkpoint.format.manifest import manifest_key, parse_step_dir, read_manifest
from unbroken.checkpoint.manager import CheckpointManager, SaveStats
from unbroken.integrations import checkpoint_dict, checkpoint_paths
from unbroken.integrations.lightning_epochs import (
    at_epoch_start,
    end_epoch_of,
    epochs_begun_as_started,
    load_positions_lightning_left,
    pulls_batches,
)
from unbroken.integrations.lightning_strategy import save_on_every_rank, trainer_save
from unbroken.integrations.live_state import LiveState
from unbroken.state.rng import capture_rng_state, restore_rng_state
from unbroken.storage import LocalStore, Store, open_store

log = logging.getLogger(__name__)

__all__ = ["UnbrokenCallback", "UnbrokenCheckpointIO", "fabric_state"]

TENSORS, TREE = "lightning", "lightning_tree"
"""The two state entries a Lightning checkpoint becomes: its tensors, its JSON rest."""


class UnbrokenCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` writing through a :class:`CheckpointManager`.

    ``url`` and ``manager_options`` make the manager (on every rank, at the Trainer's
    ``setup``). Give the Trainer ``plugins=[io]`` and ``callbacks=[io.callback]``.
    Saves are asynchronous: ``save_checkpoint`` returns once the state is staged.
    """

    def __init__(self, url: str | os.PathLike, **manager_options: Any) -> None:
        _check_manager_args(url, manager_options)  # now, not at the Trainer's setup
        self.url = os.fspath(url)
        self.options = manager_options
        self._manager: CheckpointManager | None = None
        self._restored_rng: dict[str, Any] | None = None
        self.callback = UnbrokenCallback(self)
        """The callback the Trainer needs beside this plugin."""
        self.restored_step: int | None = None
        """The step the last ``load_checkpoint`` restored."""
        self._stats: SaveStats | None = None
        self._fabric: Any = None
        self._every_rank = False  # the strategy hands every rank's checkpoint to us

    @property
    def manager(self) -> CheckpointManager:
        """The manager, made on first use: on every rank, after init_process_group."""
        if self._manager is None:
            self._manager = CheckpointManager(self.url, **self.options)
        return self._manager

    @property
    def stats(self) -> SaveStats | None:
        """The manager's save figures (kept once ``teardown`` closed it); None before."""
        return self._manager.stats if self._manager is not None else self._stats

    # -- Lightning's CheckpointIO --------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` as the step it records (``global_step``, or Fabric's
        ``step``); every rank must call it. A step already committed is not saved again."""
        self._save(checkpoint, path, storage_options)

    def _save(
        self, checkpoint: Mapping[str, Any], path: Any, storage_options: Any, filter: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "UnbrokenCheckpointIO.save_checkpoint: storage_options are the manager's "
                "(UnbrokenCheckpointIO(url, storage_options=...)), not per save"
            )
        if "loops" in checkpoint and self.callback.trainer is None:  # a Trainer's, alone
            raise RuntimeError(
                "UnbrokenCheckpointIO: the Trainer was given plugins=[io] without "
                "callbacks=[io.callback]: without it no save is made at every_steps or at a "
                "SIGTERM, and a resume loads no data position. Give the Trainer both"
            )
        if not self._every_rank and _world_size() > 1:
            raise RuntimeError(
                f"UnbrokenCheckpointIO: a save on {_world_size()} ranks is every rank's, but "
                "Lightning calls a plugin on rank 0 alone unless told otherwise: give the "
                "Trainer callbacks=[io.callback], or call io.attach(fabric) for Fabric"
            )
        epochs_begun_as_started(checkpoint)
        manager, step = self.manager, _step_of(checkpoint, path)
        trainer = self.callback.trainer
        if self.callback._at_epoch_end and trainer is not None and step == trainer.global_step:
            # an epoch's end: resume the callback's save as the next epoch starts instead
            self.callback._at_epoch_end = "asked"
            if path is not None and _rank() == 0:
                checkpoint_paths.record_alias(manager.store, os.fspath(path), step)
            return
        skipped = manager.stats.skipped_committed
        manager.save(step, self._state(checkpoint, path, filter))
        if manager.stats.skipped_committed > skipped and path is not None and _rank() == 0:
            # step already committed or in flight, under another path (or none): the
            # manifest will not record this one, so an alias does
            checkpoint_paths.record_alias(manager.store, os.fspath(path), step)

    def attach(self, fabric: Any) -> None:
        """Make ``fabric.save`` hand every rank's checkpoint to this plugin (under DDP
        Fabric calls a plugin on rank 0 alone; a save through the manager is every
        rank's), and let :meth:`maybe_save` take the state as ``fabric.save`` does:
        modules, optimizers and stateful objects, Fabric's wrappers or not. Call it once,
        before the first ``fabric.save``, on every rank."""
        from lightning.fabric.strategies import Strategy as FabricStrategy

        if fabric.strategy.checkpoint_io is not self:
            raise RuntimeError(
                "UnbrokenCheckpointIO.attach: this Fabric's checkpoint_io is "
                f"{type(fabric.strategy.checkpoint_io).__name__}, not this plugin; make it "
                "with L.Fabric(..., plugins=[io])"
            )

        def save_checkpoint(strategy, path, state, storage_options=None, filter=None):
            self._save(state, path, storage_options, filter)

        save_on_every_rank(fabric.strategy, FabricStrategy, save_checkpoint)
        self._fabric, self._every_rank = fabric, True

    def maybe_save(self, step: int, build: Callable[[], dict[str, Any]]) -> bool:
        """``maybe_save`` with the checkpoint dict built by ``build`` only if it saves."""
        made: list[checkpoint_dict.SplitCheckpoint] = []

        def part(name: str) -> Any:
            if not made:
                made.append(self._split(build()))
            return _entry(made[0], name, None)

        return self.manager.maybe_save(
            step, LiveState({}, {TENSORS: lambda: part(TENSORS), TREE: lambda: part(TREE)})
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict of the committed step ``path`` names: a path this plugin
        saved under (Lightning's name for it), a step directory or its manifest, as
        ``last_checkpoint()`` gives. Tensors come back on the CPU; nothing is unpickled."""
        del map_location, weights_only  # Lightning moves what it loads; no pickle to trust
        manager = self.manager
        step = self._step_for(os.fspath(path))
        values = json_values.decode(read_manifest(manager.store, step).extra.get("values", {}))
        tree = values.get(TREE)
        if not isinstance(tree, dict) or "skeleton" not in tree:
            raise NoCheckpointError(
                f"step {step} at {manager.store.url} was not saved by UnbrokenCheckpointIO "
                f"(its plain values are {sorted(values)})"
            )
        bag = _TensorBag(checkpoint_dict.templates(tree["skeleton"]))
        state: dict[str, Any] = {TENSORS: bag, TREE: tree}
        restored = manager.restore(state, step=step)
        self.restored_step = restored
        self._restored_rng = capture_rng_state()
        return checkpoint_dict.join(tree["skeleton"], bag.tensors)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Forget ``path``'s alias (see :mod:`.checkpoint_paths`), delete no checkpoint:
        retention is the manager's (``keep_last``, ``keep_every_steps``), which deletes a
        committed checkpoint only once a newer one is committed. Lightning asks for a
        removal as soon as its next save *starts*, which would lose the last good
        checkpoint while the new one is still uploading."""
        checkpoint_paths.remove_alias(self._store(), os.fspath(path))
        log.debug("UnbrokenCheckpointIO: %s is kept until retention removes it", path)

    def teardown(self) -> None:
        """Wait for the save in flight and close the manager (raises if a save failed)."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            self._stats = manager.stats
            manager.close()

    # -- finding checkpoints ---------------------------------------------------------------

    def last_checkpoint(self) -> str | None:
        """The manifest of the newest committed step, as a path or URL Lightning can test
        for (``ckpt_path="last"``); None if nothing is committed. Reads the durable tier
        directly, so it works before the process group (and the manager) exist."""
        store = self._store()
        committed = [c.step for c in list_checkpoints(store) if c.committed]
        if not committed:
            return None
        key = manifest_key(committed[-1])
        if isinstance(store, LocalStore):
            return os.path.join(store.root, key)
        return store.url_for(key)

    def _store(self) -> Store:
        """The durable tier, without making the manager (every rank's) if there is none."""
        if self._manager is not None:
            return self._manager.store
        return open_store(self.url, **(self.options.get("storage_options") or {}))

    def _step_for(self, path: str) -> int:
        store = self.manager.store
        for part in (os.path.basename(os.path.dirname(path)), os.path.basename(path)):
            step = parse_step_dir(part) if checkpoint_paths.inside(store, path) else None
            if step is not None:
                return step
        committed = sorted((c.step for c in list_checkpoints(store) if c.committed), reverse=True)
        names = checkpoint_paths.spellings(path)  # a relative path names what a
        # ModelCheckpoint saved under its absolute one, a link what was saved through it
        aliased = {checkpoint_paths.aliased_step(store, name) for name in names}
        for step in committed:  # a path Lightning saved under: the newest step it names
            tree = read_manifest(store, step).extra.get("values", {}).get(TREE, {})
            saved = tree.get("path") if isinstance(tree, dict) else None
            if step in aliased or (
                isinstance(saved, str) and checkpoint_paths.canonical(saved) in names
            ):
                return step
        gone = sorted(s for s in aliased if s is not None)  # named a step no longer there
        why = (
            f"named step {gone[-1]}, no longer committed (retention removed it, or its "
            "save failed)" if gone else "no committed checkpoint was saved under this path"
        )  # fmt: skip
        raise NoCheckpointError(
            f"{path}: {why} (committed steps at {store.url}: {sorted(committed) or 'none'}); "
            "for the newest pass ckpt_path='last' (Trainer) or io.last_checkpoint() (Fabric)"
        )

    # -- the state a checkpoint dict becomes -----------------------------------------------

    def _split(
        self, checkpoint: Mapping[str, Any], filter: Any = None
    ) -> checkpoint_dict.SplitCheckpoint:
        if self._fabric is not None:  # Fabric's state: modules and optimizers, maybe wrapped
            from lightning.fabric.wrappers import _unwrap_objects

            state = _unwrap_objects(dict(checkpoint))
            modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
            checkpoint = self._fabric.strategy._convert_stateful_objects_in_state(
                state, filter or {}
            )
        else:
            module = self.callback.trainer.lightning_module if self.callback.trainer else None
            modules = [module] if module is not None else []
        buffers = [b for module in modules for b in module.buffers()]
        return checkpoint_dict.split(checkpoint, copy_now=buffers)

    def _state(
        self, checkpoint: Mapping[str, Any], path: Any, filter: Any = None
    ) -> dict[str, Any]:
        made = self._split(checkpoint, filter)
        return {TENSORS: _entry(made, TENSORS, path), TREE: _entry(made, TREE, path)}


def _entry(made: checkpoint_dict.SplitCheckpoint, name: str, path: Any) -> Any:
    if name == TENSORS:
        return _TensorBag(made.tensors)
    saved = None if path is None else checkpoint_paths.canonical(os.fspath(path))
    return {"skeleton": made.skeleton, "path": saved}


class _TensorBag:
    """A flat ``{key: tensor}`` as a state entry with ``state_dict``/``load_state_dict``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(state)


def _step_of(checkpoint: Mapping[str, Any], path: Any) -> int:
    for key in ("global_step", "step"):
        step = checkpoint.get(key)
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
    found = [f"{k!r} is {checkpoint[k]!r} ({type(checkpoint[k]).__name__})" for k in
             ("global_step", "step") if k in checkpoint]  # fmt: skip
    raise ValueError(
        f"UnbrokenCheckpointIO: the checkpoint saved to {path} has no 'global_step' or "
        "'step' that is a non-negative int (unbroken names each checkpoint by its step)"
        + (f": {'; '.join(found)}; pass int(step)" if found else "")
    )


class UnbrokenCallback(OnExceptionCheckpoint):
    """What :class:`UnbrokenCheckpointIO` needs from the Trainer (see the module's doc).

    It is an ``OnExceptionCheckpoint`` so that Lightning's ``ckpt_path="last"`` (and a
    ``fit`` without ``ckpt_path``) considers its ``ckpt_path``: the newest committed
    step. Unlike Lightning's, it saves nothing on an exception (a save is collective and
    the other ranks are not saving) and removes nothing at teardown.

    Being a ``Checkpoint``, it needs the Trainer's ``enable_checkpointing=True`` (the
    default): with ``False`` Lightning refuses every checkpoint callback ("found
    `ModelCheckpoint` in callbacks list"). The default writes nothing of Lightning's own:
    Lightning adds its default ``ModelCheckpoint`` only when no checkpoint callback is
    given, and this is one.
    """

    def __init__(self, io: UnbrokenCheckpointIO) -> None:
        Callback.__init__(self)
        self.io = io
        self.trainer: Any = None
        self.dirpath, self.filename = io.url, "last"
        self._last_step: int | None = None  # global_step at the last batch end
        self._at_epoch_end: bool | str = False  # the epoch's last step, saved as the next
        # one starts ("asked": a save was asked for there, made then whatever the cadence)

    @property
    def ckpt_path(self) -> str:  # type: ignore[override]
        return self.io.last_checkpoint() or ""

    @property
    def state_key(self) -> str:
        return "UnbrokenCallback"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.io:
            raise RuntimeError(
                "UnbrokenCallback: the Trainer's checkpoint_io is "
                f"{type(trainer.strategy.checkpoint_io).__name__}, not this callback's "
                "UnbrokenCheckpointIO; pass plugins=[io] and callbacks=[io.callback]"
            )
        self.trainer = trainer
        save_on_every_rank(trainer.strategy, Strategy, trainer_save)
        self.io._every_rank = True
        self.io.manager  # noqa: B018 - made here: every rank, the process group up

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_step = trainer.global_step  # as restored
        load_positions_lightning_left(trainer.fit_loop)
        if self.io.options.get("preemption", "exit") != "off":
            _take_sigterm_from_lightning(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx + 1 >= trainer.num_training_batches and not pulls_batches(pl_module):
            # Lightning ends its epoch at this batch, so does every save in it (ours, a
            # ModelCheckpoint's, in whatever order Lightning runs the callbacks)
            end_epoch_of(trainer.train_dataloader)
        rng, self.io._restored_rng = self.io._restored_rng, None
        if rng is not None:
            restore_rng_state(rng)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if idx + 1 >= trainer.num_training_batches and pulls_batches(pl_module):
            # a training_step(dataloader_iter) fetched its batches in the step, and idx
            # is the last it fetched (a ModelCheckpoint before us saved mid-epoch then)
            end_epoch_of(trainer.train_dataloader)
        stepped, self._last_step = trainer.global_step != self._last_step, trainer.global_step
        if not stepped:  # mid-accumulation: a save (SIGTERM's too) waits for the step
            return
        if 0 <= trainer.max_steps <= trainer.global_step:  # the fit's last step
            # Saved here, mid-epoch like every other save: by on_train_end Lightning has
            # counted the epoch done, and a longer fit resumed from that state would start
            # the next epoch (current_epoch one ahead of an uninterrupted run).
            self.io.manager.save(trainer.global_step, self.io._state(_dump(trainer), None))
        elif idx + 1 >= trainer.num_training_batches:  # after the epoch's validation
            self._at_epoch_end = True  # (and its callbacks)
        else:
            self.io.maybe_save(trainer.global_step, lambda: _dump(trainer))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """The step that ended the epoch before, once that epoch's validation and every
        callback's epoch end ran (a ModelCheckpoint's save there is the step's, and this
        one is skipped), before the new epoch fetches a batch: a save before them held
        the callbacks' state of before, and a resume from it never validated the epoch.
        The fit's last epoch has its save at on_train_end."""
        ended, self._at_epoch_end = self._at_epoch_end, False
        if ended == "asked":  # a ModelCheckpoint's save of the epoch's end, made here
            self.io.manager.save(
                trainer.global_step, self.io._state(at_epoch_start(_dump(trainer)), None)
            )
        elif ended:
            self.io.maybe_save(trainer.global_step, lambda: at_epoch_start(_dump(trainer)))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The last step too (a no-op if saved already: a fit that ran to max_steps), and
        wait for it."""
        self.io.manager.save(trainer.global_step, self.io._state(_dump(trainer), None))
        self.io.manager.wait()

    def on_exception(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def teardown(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _dump(trainer: Any) -> dict[str, Any]:
    """Lightning's checkpoint dict as ``trainer.save_checkpoint`` would write it."""
    connector = trainer._checkpoint_connector
    return epochs_begun_as_started(connector.dump_checkpoint(weights_only=False))


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _check_manager_args(url: Any, options: Mapping[str, Any]) -> None:
    """What ``CheckpointManager(url, **options)`` would refuse at the Trainer's setup,
    refused at construction: a typo in an option name fails where it was written."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(
            f"UnbrokenCheckpointIO: url must be a str or os.PathLike (a path or a URL such "
            f"as 's3://bucket/run'), got {type(url).__name__}"
        )
    check_option_names(options, "UnbrokenCheckpointIO")  # "url" too: it is given once


def _take_sigterm_from_lightning(trainer: Any) -> None:
    """Lightning's SIGTERM handler broadcasts on the default group from inside the
    handler and stops the loop at the end of the batch, with no save: take it out of the
    chain, so that the manager's handler (installed before it) saves the step reached."""
    current = signal.getsignal(signal.SIGTERM)
    if not isinstance(current, _HandlersCompose):
        return
    connector = trainer._signal_connector
    rest = [h for h in current.signal_handlers if getattr(h, "__self__", None) is not connector]
    handler = rest[0] if len(rest) == 1 else _HandlersCompose(rest) if rest else signal.SIG_DFL
    signal.signal(signal.SIGTERM, handler)


def fabric_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with Fabric's wrappers taken off, for a ``CheckpointManager``: the module
    ``fabric.setup`` wrapped and the torch optimizer inside ``_FabricOptimizer``, so the
    optimizer is saved (and resharded) as an optimizer."""
    from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

    out = {}
    for name, value in state.items():
        if isinstance(value, _FabricModule):
            value = value.module
        elif isinstance(value, _FabricOptimizer):
            value = value.optimizer
        out[name] = value
    return out
