"""Checkpoint errors: each names what is wrong and where (step, file, URL)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unbroken.storage.errors import StoreError


class CheckpointError(Exception):
    """Base class for every checkpoint failure."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes are missing, short, or do not match their recorded checksum."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        file: str | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.file = file
        self.url = url


class NewerFormatError(CheckpointError):
    """A checkpoint was written by a newer unbroken, in a format this one cannot read.

    It is not corrupt: restore refuses it instead of falling back to an older step (whose
    run would save over it), and retention never deletes it. Upgrade unbroken to use it.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        format: int | None = None,
        library_version: str | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.format = format
        self.library_version = library_version
        self.url = url


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's keys or shapes differ from what the caller asked to load."""


class NoCheckpointError(CheckpointError):
    """No (committed) checkpoint where one was required."""


class ListingFailedError(CheckpointError, StoreError):
    """A restore could not list the durable tier (not a corrupt checkpoint): the same
    error on every rank, a StoreError too (its cause, the store's, is chained)."""


class OlderStepRestoredError(CheckpointError):
    """A save into a URL where the run was restored at an older step than its newest:
    the two runs' checkpoints would mix, and an automatic restart would load the other's."""

    def __init__(self, url: str, step: int, newer: list[int]) -> None:
        from unbroken.checkpoint.format.manifest import step_dir  # it imports this module

        shown = ", ".join(map(str, newer[:8])) + (", ..." if len(newer) > 8 else "")
        super().__init__(
            f"restored step {step} of {url}, where steps {shown} are committed too: an "
            f"automatic restart would load step {newer[-1]}, and this run's saves would mix "
            f"with them (a committed step is never overwritten), so this manager refuses "
            f"every save. To go on from step {step} as a new run, save into another URL "
            f"(restore with this manager, save with a CheckpointManager of that URL; or copy "
            f"{step_dir(step)} there and run on it); or move steps {shown} out of {url} and "
            f"restore again"
        )
        self.url, self.step, self.newer = url, step, newer

    def __reduce__(self) -> tuple:  # its arguments, not its message: it crosses processes
        return (type(self), (self.url, self.step, self.newer))


class SaveFailedError(CheckpointError):
    """A background save failed; ``step`` says which, ``__cause__`` and ``cause`` why."""

    def __init__(
        self, step: int, cause: BaseException | None = None, message: str | None = None
    ) -> None:
        text = message or f"checkpoint save of step {step} failed"
        if cause is not None and message is None:
            text += f": {type(cause).__name__}: {cause}"
        super().__init__(text)
        self.step = step
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause


class OtherWriterError(CheckpointError):
    """Another job saves or committed this step at the same URL (two writers on one URL)."""

    def __init__(self, message: str, *, step: int, url: str) -> None:
        super().__init__(message)
        self.step = step
        self.url = url


class SaveRefusedError(SaveFailedError):
    """A save that can never commit as the job runs now: raised from the ``save`` /
    ``maybe_save`` / ``wait`` that learns of it, whatever ``raise_on_failure`` says (a job
    warned about it would train on for days with every save failing). ``step``: the save's,
    ``url``: where it was refused."""

    _FIELDS: tuple[str, ...] = ("step", "url")

    def __init__(self, message: str, *, step: int, url: str) -> None:
        CheckpointError.__init__(self, message)
        self.step = step
        self.url = url
        self.cause = None

    def fields(self) -> dict[str, Any]:
        """Plain values that rebuild it on another rank (a collective carries these)."""
        return {"kind": type(self).__name__, "message": str(self),
                **{name: getattr(self, name) for name in self._FIELDS}}  # fmt: skip


class OtherJobError(SaveRefusedError, OtherWriterError):
    """Another job is saving to this URL while this one runs: a conflict that never heals.

    It holds a claim made after this job started, or runs on this host, or won a commit
    this job raced it for: two jobs on one URL skip each other's steps and restore each
    other's checkpoints. ``this_job`` and ``other_job`` name both."""

    _FIELDS = ("step", "url", "this_job", "other_job")

    def __init__(self, message: str, *, step: int, url: str, this_job: str, other_job: str) -> None:
        SaveRefusedError.__init__(self, message, step=step, url=url)
        self.this_job = this_job
        self.other_job = other_job


class StepBehindError(SaveRefusedError):
    """A save of a step older than the newest committed at the URL (a run that started
    there without ``restore``, or whose step went back): retention would remove it as
    soon as it commits, and a restart would load ``newest``, another run's progress."""

    _FIELDS = ("step", "url", "newest")

    def __init__(self, message: str, *, step: int, url: str, newest: int) -> None:
        SaveRefusedError.__init__(self, message, step=step, url=url)
        self.newest = newest

    @classmethod
    def at(cls, step: int, url: str, newest: int) -> StepBehindError:
        """``newest``, committed at ``url`` by another run or an earlier attempt of this
        one, is ``step`` or newer, and this run did not restore it."""
        if newest == step:
            why = (f"step {step} is already committed at {url}, and this run did not "
                   f"restore it: a committed step is never overwritten, and this run's "
                   f"next saves would mix with that run's steps")  # fmt: skip
        else:
            why = (f"step {step} is older than step {newest}, committed at {url}: retention "
                   f"would remove step {step} as soon as it commits, and a restart would "
                   f"load step {newest}")  # fmt: skip
        steps = f"the steps after {step}" if newest > step else f"step {step} and those after"
        return cls(
            f"{why}. To go on from step {newest}, call restore(state) before the first "
            f"save; to start a new run, give it a URL of its own (or move {steps} out of "
            f"{url})",
            step=step,
            url=url,
            newest=newest,
        )

    @classmethod
    def in_run(cls, step: int, url: str, newest: int, how: str) -> StepBehindError:
        """This run's own step went back: it ``how`` ("saved", "restored") ``newest``."""
        return cls(
            f"step {step} is older than step {newest}, which this run {how} at {url}: the "
            f"steps a run saves must only grow (retention keeps the newest, and a restart "
            f"would load step {newest}). Count the step over the whole run, not per epoch "
            f"(epoch * steps_per_epoch + i), and go on from the step restore(state) returns",
            step=step,
            url=url,
            newest=newest,
        )


class StepsDisagreeError(SaveRefusedError):
    """The ranks saved different steps at the same call: a step counted per rank (batches
    of an uneven loader, say) can never make one checkpoint."""

    @classmethod
    def of(cls, steps: list[int], url: str) -> StepsDisagreeError:
        shown = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps[:8]))
        more = ", ..." if len(steps) > 8 else ""
        return cls(
            f"the ranks saved different steps ({shown}{more}): every rank calls save() and "
            "maybe_save() with the same step, counted the same way on every rank",
            step=steps[0],
            url=url,
        )


def refusal_from_fields(fields: dict[str, Any], message: str | None = None) -> SaveRefusedError:
    """The SaveRefusedError ``fields()`` came from (``message``: a new text for it)."""
    kinds = {
        k.__name__: k
        for k in (SaveRefusedError, OtherJobError, StepBehindError, StepsDisagreeError)
    }
    args = {k: v for k, v in fields.items() if k != "kind"}
    if message is not None:
        args["message"] = message
    return kinds[fields["kind"]](**args)


def raise_if_interrupted(failures: Mapping[int, BaseException], rank: int, step: int) -> None:
    """A Ctrl-C or ``sys.exit`` inside a restore's read (DCP gathers it with the ranks'
    failures) is the user stopping it, not a bad copy to fall back from: the rank it hit
    raises it again, the others say which rank stopped."""
    stopped = {r: e for r, e in failures.items() if isinstance(e, (KeyboardInterrupt, SystemExit))}
    if rank in stopped:
        raise stopped[rank]
    if stopped:
        first = min(stopped)
        raise CheckpointError(
            f"restoring step {step} was stopped: rank {first} was interrupted "
            f"({type(stopped[first]).__name__}) while reading it"
        )
