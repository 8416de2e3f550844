"""The job's timeline as a picture: one lane per attempt, colored by category."""

from __future__ import annotations

import os
from collections.abc import Sequence

from unbroken.cli.errors import CliError
from unbroken.goodput.breakdown import CATEGORIES, Breakdown

COLORS = {
    "productive": "#2ca02c",
    "data_wait": "#ff7f0e",
    "checkpoint_save": "#1f77b4",
    "checkpoint_restore": "#9467bd",
    "startup": "#8c564b",
    "wasted": "#d62728",
    "down": "#7f7f7f",
    "other": "#c7c7c7",
}


def lane_of(b: Breakdown, t: float) -> int:
    """The index of the attempt running at wall time ``t`` (its lane; "attempt" index+1)."""
    return max([i for i, a in enumerate(b.attempts) if a.start <= t] or [0])


def plot_path(path: str) -> str:
    """Where ``--plot path`` writes: ``path`` itself, ``timeline.png`` in it where it is a
    directory (one ending in a slash is made), ``path.png`` where it names no format
    (matplotlib would add it unsaid)."""
    if path.endswith(("/", os.sep)):
        os.makedirs(path, exist_ok=True)
    if os.path.isdir(path):
        return os.path.join(path, "timeline.png")
    if not os.path.splitext("x" + os.path.basename(path))[1].strip("."):  # ".png" is png
        return path.rstrip(".") + ".png"
    return path


def plot_timeline(
    b: Breakdown,
    path: str,
    *,
    kills: Sequence[float] = (),
    reference: float | None = None,
) -> str:
    """Draw the timeline into the file :func:`plot_path` makes of ``path`` (PNG, or the
    format its suffix names) and return that file's path; matplotlib is optional.
    ``kills``: the wall times a process was killed, where the caller knows them (marked
    instead of each crashed attempt's last event); ``reference``: the goodput to compare
    with."""
    path = plot_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise CliError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc
    t0 = b.attempts[0].start
    lanes = {a.attempt: i for i, a in enumerate(b.attempts)}
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.5 * len(lanes)))
    for s in b.segments:
        y = lanes[s.attempt]
        ax.broken_barh(
            [(s.begin - t0, s.end - s.begin)],
            (y - 0.4, 0.8),
            facecolors=COLORS[s.category],
            linewidth=0,
        )
    crosses = [(t - t0, lane_of(b, t)) for t in kills] or [
        (a.end - t0, lanes[a.attempt]) for a in b.attempts if not a.clean
    ]
    for x, y in crosses:
        ax.plot([x], [y], marker="x", color="black", markersize=10)
    ax.set_yticks(range(len(lanes)), [f"attempt {i + 1}" for i in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first process started")
    restarts = f"{b.restarts} restart" + ("" if b.restarts == 1 else "s")
    versus = f" (without failures: {reference:.1%})" if reference is not None else ""
    mark = "a kill" if kills else "a crash, at its last event"
    ax.set_title(f"goodput {b.goodput:.1%}{versus}, {restarts} (x: {mark})")
    used = [c for c in CATEGORIES if b.seconds[c] > 0]
    handles = [Patch(color=COLORS[c], label=c) for c in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(used), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc}") from exc
    except ValueError as exc:  # a suffix matplotlib has no format for
        raise CliError(f"--plot {path}: {exc}", code=2) from exc
    finally:
        plt.close(fig)
    return path
