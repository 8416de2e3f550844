"""Measuring tools for bench/checkpoint/saves.py: memory sampling and the report (pure parts).

Memory is the proportional set size (PSS) of a rank and the helper processes it starts
during a row (DCP's checkpoint process, background uploaders): shared-memory staging
buffers count once, not once per process that maps them. Most files in unbroken's
memory tier are shared memory that no process maps (written and read with system
calls), so PSS does not see them: the sampler adds the rank's share of the bytes that
appeared under the memory tier's root since it started. Its arenas (the files a rank
stages into, then links into a step) are mapped by their rank: PSS has them already,
and they are left out of the tier's count.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from unbroken.checkpoint.memory_tier import default_root
from unbroken.checkpoint.staging.arena import ARENAS_DIR

GiB = float(1 << 30)


def unmapped_tier_bytes(path: str) -> int:
    """Bytes of a memory-tier directory's files that no process maps: all but its
    arenas (mapped by their ranks, so in their PSS); a file linked twice counts once."""
    seen: set[tuple[int, int]] = set()
    arenas = os.path.join(path, ARENAS_DIR)
    for name in _entries(arenas):
        try:
            st = os.stat(os.path.join(arenas, name))
        except OSError:
            continue
        seen.add((st.st_dev, st.st_ino))
    total = 0
    for folder, _, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(folder, n))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def tree_pss(root: psutil.Process, exclude: set[int]) -> int:
    """PSS bytes of ``root`` and its descendants, minus the pids in ``exclude``."""
    total = 0
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    for p in procs:
        if p.pid in exclude:
            continue
        try:
            total += p.memory_full_info().pss
        except psutil.Error:  # exited while we looked
            continue
    return total


def ranks_on_node() -> int:
    """The ranks that share this node's memory tier: torchrun's LOCAL_WORLD_SIZE, else
    the world (the benchmarks start every rank on this machine)."""
    import torch.distributed as dist

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    return dist.get_world_size() if dist.is_initialized() else 1


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


class MemorySampler:
    """Samples this process tree's PSS in a thread; ``peak`` is the highest sample.

    A peak shorter than the sampling pause (50 ms, longer for large processes) can be
    missed; the staging copies of a large state last far longer than that.
    """

    def __init__(self, interval: float = 0.05, *, tier_share: int = 1) -> None:
        """``tier_share``: the ranks on this node, which share its memory tier."""
        self._proc = psutil.Process()
        self._exclude = {c.pid for c in self._proc.children(recursive=True)}
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tier_root = default_root()
        self._tiers_before = set(_entries(self._tier_root))
        self._tier_share = max(1, tier_share)
        self.peak = 0

    def tier_bytes(self) -> int:
        """Bytes of the memory-tier directories made since the sampler started: not the
        ones already there (another job's, or a dead one's that the row's manager may
        sweep meanwhile), so a sweep does not hide the row's own."""
        new = [e for e in _entries(self._tier_root) if e not in self._tiers_before]
        return sum(unmapped_tier_bytes(os.path.join(self._tier_root, e)) for e in new)

    def sample(self) -> int:
        value = tree_pss(self._proc, self._exclude) + self.tier_bytes() // self._tier_share
        self.peak = max(self.peak, value)
        return value

    def start(self) -> MemorySampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # Reading PSS walks the page tables (~40 ms for 2 GiB here): wait ten times as
        # long as a sample took, so the sampler never takes more than ~10% of a core.
        pause = self._interval
        while not self._stop.wait(pause):
            t0 = time.perf_counter()
            self.sample()
            pause = max(self._interval, 10 * (time.perf_counter() - t0))

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.peak


def evict_from_page_cache(root: str) -> int:
    """Drop every file under ``root`` from the page cache, so the next read hits the disk.

    A restore after a node restart reads cold files; so does each timed restore here. Only
    clean pages are dropped, and only of these files. Returns the bytes concerned.
    """
    total = 0
    paths = (
        [root]
        if os.path.isfile(root)
        else [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    )
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # deleted while we walked
            continue
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def cold_read_bandwidth(paths: Sequence[str]) -> float | None:
    """Bytes/second of one sequential reader over ``paths`` from a cold page cache."""
    for path in paths:
        evict_from_page_cache(path)
    nbytes, buf = 0, bytearray(16 << 20)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                nbytes += n
    seconds = time.perf_counter() - t0
    for path in paths:
        evict_from_page_cache(path)
    return nbytes / seconds if nbytes and seconds > 0 else None


@dataclass
class CpuClocks:
    """CPU seconds spent so far: the whole machine, this process, its calling thread."""

    machine_s: float
    """Busy time of every core (kernel threads, page-cache writeback and helpers included)."""
    process_s: float
    main_thread_s: float

    def minus(self, earlier: CpuClocks) -> CpuClocks:
        return CpuClocks(
            self.machine_s - earlier.machine_s,
            self.process_s - earlier.process_s,
            self.main_thread_s - earlier.main_thread_s,
        )


def cpu_clocks() -> CpuClocks:
    """Where a save's CPU goes: off the training thread, or outside the process."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user, nice, system, irq, softirq: not idle or iowait, and not steal (time the
    # hypervisor gave to other guests); guest time is already inside user.
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6) if i < len(fields))
    times = os.times()
    return CpuClocks(busy / os.sysconf("SC_CLK_TCK"), times.user + times.system, time.thread_time())


def excess_over_median(durations: Sequence[float], flagged: Sequence[bool]) -> float:
    """Sum of how much the flagged durations exceed the median of the unflagged ones.

    The optimizer step right after a save may wait for a background copy (a hook the
    library installs); the excess over an ordinary optimizer step is time the loop is
    blocked by that save.
    """
    normal = sorted(d for d, f in zip(durations, flagged) if not f)
    if not normal:
        return 0.0
    mid = len(normal) // 2
    median = normal[mid] if len(normal) % 2 else (normal[mid - 1] + normal[mid]) / 2
    return sum(max(0.0, d - median) for d, f in zip(durations, flagged) if f)


@dataclass
class StepSplit:
    """A saving run's steps, split by where they fall relative to its saves."""

    before: list[float]
    """Steps before the first save."""
    quiet: list[float]
    """Steps starting at least ``settle_s`` after the latest save was due."""
    busy: list[float]
    """Save steps, and steps with a save in flight."""
    saves: int


def split_steps(step_ends: Sequence[float], every: int, settle_s: float) -> StepSplit:
    """Each step's duration, sorted into before / quiet / busy (a save every ``every``)."""
    split = StepSplit([], [], [], 0)
    due: float | None = None  # when the latest save was due (the end of its step)
    start = 0.0
    for step, end in enumerate(step_ends, start=1):
        if step % every == 0:
            split.saves += 1
            due = end
            split.busy.append(end - start)
        elif due is None:
            split.before.append(end - start)
        elif start >= due + settle_s:
            split.quiet.append(end - start)
        else:
            split.busy.append(end - start)
        start = end
    return split


def in_row_extra(step_ends: Sequence[float], every: int, settle_s: float) -> float | None:
    """Extra wall seconds per save, against the quiet steps of the same run.

    The row-level figure compares loops run minutes apart, and this machine drifts by a
    few per cent between such runs (the two no-saves runs show how much): with a handful
    of saves that drift is larger than what a cheap save costs. Here the yardstick is the
    mean of this run's own quiet steps: steps starting at least ``settle_s`` (the row's
    commit time) after the latest save was due. The figure is what the other steps (save
    steps, and steps with a save in flight) take beyond that mean, per save. Applied to a
    run without saves it shows its own noise. What outlasts a save's window (a lasting
    slowdown) is not seen here: :func:`lasting_extra` is that part.

    The steps before the first save count as quiet only when there are no others (saves
    closer together than their commit time): the first steps of a row often run slow
    (30 Nov: 0.5-1.9 s per step in three of six unbroken rows), and a yardstick that
    includes them makes the saves look cheaper than they are.
    """
    split = split_steps(step_ends, every, settle_s)
    quiet = split.quiet or split.before
    if not quiet or not split.saves:
        return None
    mean = sum(quiet) / len(quiet)
    return sum(d - mean for d in split.busy) / split.saves


def lasting_extra(
    step_ends: Sequence[float], every: int, settle_s: float, base_step_s: float
) -> float | None:
    """Seconds per save by which a run's quiet steps exceed the no-saves runs' mean step.

    The part of the extra wall time that outlasts each save's window: if the steps after
    a save has committed still run slower than steps in a run that never saves, every step
    from the first save on pays that difference (the in-row figure measures the busy steps
    against these quiet ones, so the two add up). It compares runs minutes apart, so the
    drift between the two no-saves runs bounds what it can resolve. None without quiet
    steps or saves.
    """
    split = split_steps(step_ends, every, settle_s)
    if not split.quiet or not split.saves:
        return None
    excess = sum(split.quiet) / len(split.quiet) - base_step_s
    return excess * (len(split.quiet) + len(split.busy)) / split.saves


# -- the report ---------------------------------------------------------------------------


@dataclass
class Column:
    key: str
    title: str
    scale: float = 1.0
    digits: int = 3
    main: bool = False
    """Shown by default; the others only with ``--all-columns``."""


COLUMNS = [
    Column("blocked_s", "loop blocked s/save", main=True),
    Column("extra_s", "time lost s/save", main=True),
    Column("in_row_extra_s", "lost in run s/save"),
    Column("lasting_extra_s", "lost after commit s/save"),
    Column("commit_s", "save to commit s", main=True),
    Column("extra_cpu_s", "machine CPU s/save"),
    Column("off_main_cpu_s", "background CPU s/save"),
    Column("peak_pss", "peak memory GiB", GiB, 2),
    Column("rss_growth", "memory growth GiB", GiB, 3, main=True),
    Column("restore_local_s", "restore local s", main=True),
    Column("restore_durable_s", "restore remote s", main=True),
]
"""Every column, in order; the ``main`` ones are what a user compares (and the targets)."""


def shown_columns(all_columns: bool = False) -> list[Column]:
    """The columns a report prints: the main ones, or every one."""
    return [c for c in COLUMNS if all_columns or c.main]


def _cell(row: dict, col: Column) -> str:
    value = row.get(col.key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value / col.scale:.{col.digits}f}"


def format_table(rows: Sequence[dict], all_columns: bool = False) -> str:
    """One aligned text table; a row with an ``error`` shows n/a and the reason."""
    columns = shown_columns(all_columns)
    header = ["row", *(c.title for c in columns)]
    body = []
    notes = []
    for r in rows:
        if r.get("error"):
            body.append([r["name"], *("n/a" for _ in columns)])
            notes.append(f"  {r['name']}: n/a: {r['error']}")
        else:
            body.append([r["name"], *(_cell(r, c) for c in columns)])
            if r.get("skipped_saves"):
                notes.append(f"  {r['name']}: skipped {r['skipped_saves']} due saves (busy)")
            if r.get("own_blocked_s") is not None:
                commit = r.get("own_last_commit_s")
                notes.append(
                    f"  {r['name']}: by its own count (wait() included): "
                    f"blocked {r['own_blocked_s']:.3f} s/save, "
                    f"last commit {'n/a' if commit is None else f'{commit:.3f}'} s"
                )
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        first = line[0].ljust(widths[0])
        rest = (cell.rjust(w) for cell, w in zip(line[1:], widths[1:]))
        return "  ".join([first, *rest])

    out = [fmt(header), "  ".join("-" * w for w in widths), *(fmt(b) for b in body)]
    return "\n".join(out + notes)


@dataclass
class Target:
    name: str
    measured: float | None
    bound: float | None
    unit: str
    met: bool | None = field(default=None)
    aside: str = ""
    """A second measurement of the same quantity, shown beside the verdict."""


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def evaluate(rows: dict[str, dict], env: dict) -> tuple[list[Target], dict]:
    """The issue's targets for the unbroken row, and the ratios of the final JSON line.

    ``rows`` maps row keys (``torch_save``, ``dcp_async_default``, ``dcp_async_best``,
    ``unbroken``, ``floor``, ``floor_2tier``) to their results; ``env`` holds
    ``state_bytes`` (all ranks), ``rank_bytes`` (the largest rank), ``bandwidth``,
    ``latency`` and ``local_tier_bps`` (measured, may be None).
    """

    def get(row: str, key: str) -> float | None:
        r = rows.get(row) or {}
        return None if r.get("error") else r.get(key)

    ub_extra = get("unbroken", "extra_s")
    ub_in_row = get("unbroken", "in_row_extra_s")
    ub_lasting = get("unbroken", "lasting_extra_s")
    in_row_aside = "" if ub_in_row is None else f"lost in run {ub_in_row:.3f}"
    if in_row_aside and ub_lasting is not None:
        in_row_aside += f", after commit {ub_lasting:.3f}"
    asyncs = [
        v
        for v in (get("dcp_async_default", "extra_s"), get("dcp_async_best", "extra_s"))
        if v is not None
    ]
    best_async = min(asyncs) if asyncs else None
    torch_extra = get("torch_save", "extra_s")
    link_floor = env["state_bytes"] / env["bandwidth"] + env["latency"]
    ub_commit = get("unbroken", "commit_s")
    pool = env["rank_bytes"]
    growth = get("unbroken", "rss_growth")
    growth_beyond = None if growth is None else growth - pool
    # the training loop's own heap grows too (glibc keeps freed memory: see
    # docs/arch/bench-checkpoint.md); what saves add is growth beyond the no-saves run's
    baseline_growths = [get(b, "rss_growth") for b in ("baseline", "baseline_end")]
    baseline_growth = max([g for g in baseline_growths if g is not None], default=0.0)
    growth_net = None if growth_beyond is None else growth_beyond - max(0.0, baseline_growth)
    tolerance = max(64 << 20, 0.05 * pool)
    local_s, durable_s = get("unbroken", "restore_local_s"), get("unbroken", "restore_durable_s")
    local_bps = env["state_bytes"] / local_s if local_s else None
    durable_bps = env["state_bytes"] / durable_s if durable_s else None
    local_frac = _ratio(local_bps, env.get("local_tier_bps"))
    durable_frac = _ratio(durable_bps, env["bandwidth"])

    def le(value: float | None, bound: float | None) -> bool | None:
        return None if value is None or bound is None else value <= bound

    targets = [
        Target(
            "time lost s/save <= 0.5 x best dcp.async_save",
            ub_extra,
            None if best_async is None else 0.5 * best_async,
            "s",
            aside=in_row_aside,
        ),
        Target(
            "time lost s/save <= torch.save / 50",
            ub_extra,
            None if torch_extra is None else torch_extra / 50,
            "s",
            aside=in_row_aside,
        ),
        Target(
            "save to commit s <= 1.25 x (bytes/bandwidth + latency)",
            ub_commit,
            1.25 * link_floor,
            "s",
        ),
        Target(
            "memory growth beyond one staging pool and the no-saves run's ~ 0",
            growth_net,
            tolerance,
            "bytes",
        ),
        Target("restore local >= 0.8 x local disk bandwidth", local_frac, 0.8, "fraction"),
        Target("restore remote >= 0.8 x link bandwidth", durable_frac, 0.8, "fraction"),
    ]
    for t in targets[:4]:
        t.met = le(t.measured, t.bound)
    for t in targets[4:]:
        t.met = None if t.measured is None else t.measured >= t.bound

    ratios = {
        "extra_wall_unbroken_over_best_dcp_async": _ratio(ub_extra, best_async),
        "extra_wall_torch_save_over_unbroken": _ratio(torch_extra, ub_extra),
        "extra_wall_in_row_unbroken_over_best_dcp_async": _ratio(
            ub_in_row, get("dcp_async_best", "in_row_extra_s")
        ),
        "extra_wall_in_row_torch_save_over_unbroken": _ratio(
            get("torch_save", "in_row_extra_s"), ub_in_row
        ),
        "commit_unbroken_over_link_floor": _ratio(ub_commit, link_floor),
        "rss_growth_beyond_pool_gib": None if growth_beyond is None else growth_beyond / GiB,
        "rss_growth_beyond_pool_and_no_saves_gib": None if growth_net is None else growth_net / GiB,
        "restore_local_fraction_of_tier_bw": local_frac,
        "restore_durable_fraction_of_link_bw": durable_frac,
        "blocked_unbroken_over_floor": _ratio(
            get("unbroken", "blocked_s"), get("floor", "blocked_s")
        ),
        # What this machine's disk charges any save that writes both tiers, side by side.
        "extra_wall_unbroken_over_floor_2tier": _ratio(ub_extra, get("floor_2tier", "extra_s")),
        "extra_wall_torch_save_over_floor_2tier": _ratio(
            torch_extra, get("floor_2tier", "extra_s")
        ),
        "targets_met": sum(1 for t in targets if t.met),
        "targets_total": len(targets),
    }
    return targets, ratios


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value / GiB:.3f} GiB" if unit == "bytes" else f"{value:.3f}"


def format_targets(targets: Sequence[Target]) -> str:
    lines = ["targets (unbroken row; reported, not asserted):"]
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t.met]
        aside = f" ({t.aside})" if t.aside else ""
        lines.append(
            f"  {t.name}: measured {_show(t.measured, t.unit)}, "
            f"bound {_show(t.bound, t.unit)}: {verdict}{aside}"
        )
    return "\n".join(lines)


def json_line(ratios: dict, extra: dict) -> str:
    def clean(v: object) -> object:
        if isinstance(v, float):
            return None if math.isnan(v) else round(v, 4)
        return v

    merged = {**ratios, **extra}
    return json.dumps({k: clean(v) for k, v in merged.items()}, sort_keys=True)
