"""Run the examples under real torchrun agents and SIGKILL their ranks from outside.

An :class:`Agent` is one torchrun agent (one "node") running an example, its output read
line by line as it comes, with the moment each line arrived. :func:`save_phase` says
what the checkpoint pipeline was doing at a given moment, from the files the tiers hold
(what a kill at that moment interrupts). :class:`Kill` is one kill and what the tiers
held then; :func:`check_run` compares a crashed run with an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.checkpoint.distributed import ROOT, dump_stacks, free_port, kill_tree, rank_env
from unbroken.checkpoint.format.manifest import parse_step_dir, step_dir
from unbroken.storage.base import TEMP_MARKER

EXAMPLES = ROOT / "examples"
MANIFEST = "manifest.json"
STARTING = re.compile(r"\[rank (\d+)\] starting at step (\d+), from (?:the (\S+) tier|scratch)")
PROGRESS = re.compile(r"\[rank 0\] step (\d+) loss")
PHASES = ("step", "staging", "upload", "commit")
"""What a kill can interrupt: the training step (or the host-buffer copy, which overlaps
it and leaves nothing on disk), the local write to the staging tier, the upload to the
durable tier, the commit (manifest written, then copied into each staging tier)."""


class Agent:
    """One torchrun agent running ``script`` on ``nproc`` ranks (one node of ``nnodes``)."""

    def __init__(
        self,
        script: str,
        args: list[str],
        *,
        nproc: int = 2,
        max_restarts: int = 0,
        endpoint: str | None = None,
        nnodes: int = 1,
        hosts_store: bool = True,
        env: dict[str, str] | None = None,
        durable: Path | None = None,
    ) -> None:
        self.script = str(EXAMPLES / script)
        self.endpoint = endpoint or f"127.0.0.1:{free_port()}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", "e2e",
            # The store's host is named, not guessed: both "nodes" are this machine.
            "--rdzv-conf", f"is_host={int(hosts_store)}",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
            self.script, *args,
        ]  # fmt: skip
        self.durable = durable
        self.lines: list[tuple[float, str]] = []
        self.restored: list[tuple[int, bool]] = []
        """(step, whether its commit record was in the durable tier then) per restore."""
        self._eof = False
        self._new_line = threading.Condition()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.durable is not None:  # before the restored ranks can save anything
                for m in STARTING.finditer(line):
                    step = int(m[2])
                    if step:
                        record = self.durable / step_dir(step) / MANIFEST
                        self.restored.append((step, record.exists()))
            with self._new_line:
                self.lines.append((time.time(), line))
                self._new_line.notify_all()
        with self._new_line:
            self._eof = True
            self._new_line.notify_all()

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def starts(self) -> list[tuple[float, int, int, str | None]]:
        """(when, rank, step, tier) of every "starting at step" line so far."""
        found = []
        for t, line in list(self.lines):
            for m in STARTING.finditer(line):  # two ranks' lines may share one
                found.append((t, int(m[1]), int(m[2]), m[3]))
        return found

    def wait_until(self, found, what: str, timeout: float = 240):
        """Wait until ``found(lines)`` returns something other than None (asked at each
        new line, and every 50 ms); that."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while (value := found(list(self.lines))) is None:
                if self._eof:
                    raise AssertionError(f"the job ended before {what}:\n{self.output}")
                if time.monotonic() > deadline:
                    dump_stacks(self.proc.pid, settle=0)  # where each process waits
                    settled = time.monotonic() + 2
                    while time.monotonic() < settled:  # the reader thread takes the dumps
                        self._new_line.wait(timeout=0.1)
                    self.kill()
                    raise AssertionError(f"no {what} in {timeout}s:\n{self.output}")
                self._new_line.wait(timeout=0.05)
        return value

    def wait_for_starts(self, count: int, timeout: float = 240) -> tuple[int, int]:
        """Wait until ``count`` starts in all were announced; (line index, step) of the last."""

        def found(lines):
            seen = 0
            for i, (_, line) in enumerate(lines):
                for m in STARTING.finditer(line):
                    seen += 1
                    if seen == count:
                        return i, int(m[2])
            return None

        return self.wait_until(found, f"{count} starts", timeout)

    def wait_for_step(self, step: int, after: int, timeout: float = 240) -> float:
        """Wait until rank 0 reports ``step`` (or later) in a line past index ``after``."""

        def found(lines):
            for t, line in lines[after + 1 :]:
                if any(int(m[1]) >= step for m in PROGRESS.finditer(line)):
                    return t
            return None

        return self.wait_until(found, f"step {step}", timeout)

    def last_step(self, after: int) -> int:
        """The newest step rank 0 reported in the lines past index ``after`` (0: none)."""
        found = [int(m[1]) for _, line in self.lines[after + 1 :] for m in PROGRESS.finditer(line)]
        return max(found, default=0)

    def workers(self) -> list[psutil.Process]:
        """The ranks this agent runs now (its children running the example)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        found = []
        for p in children:
            try:
                if self.script in p.cmdline():
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    def kill_one_rank(self, rng: random.Random) -> bool:
        """SIGKILL one of this agent's ranks, chosen by ``rng``; False if none runs."""
        workers = self.workers()
        if not workers:
            return False
        try:
            rng.choice(workers).send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            return False
        return True

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Every rank stopped (SIGSTOP) while the block runs: what the tiers hold cannot
        change between looking and killing, however late the harness runs on a loaded
        machine. The ranks left alive go on after it."""
        ranks = self.workers()
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.send_signal(signal.SIGCONT)

    def helpers(self) -> list[psutil.Process]:
        """The save helpers of this agent's ranks (each rank's upload process)."""
        found = []
        for rank in self.workers():
            try:
                for p in rank.children():
                    if "unbroken.checkpoint.save_helper" in " ".join(p.cmdline()):
                        found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    def kill(self) -> None:
        """The whole node at once: the agent and every rank under it."""
        kill_tree(self.proc.pid)

    def finish(self, timeout: float = 300) -> str:
        """Wait for the job to end successfully; its output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks(self.proc.pid)
            self.kill()
            self.proc.wait(30)
            raise AssertionError(f"job timed out after {timeout}s:\n{self.output}") from None
        time.sleep(0.2)  # the reader thread drains the last lines
        assert self.proc.returncode == 0, f"job failed (rc={self.proc.returncode}):\n{self.output}"
        return self.output


def step_dirs(root: Path) -> dict[int, Path]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        step = parse_step_dir(name)
        if step is not None:
            found[step] = root / name
    return found


def fresh_files(directory: Path, since: float) -> set[str]:
    """Names (relative) of the files under ``directory`` written at or after ``since``."""
    found = set()
    for dirpath, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.stat(path).st_mtime >= since:
                    found.add(os.path.relpath(path, directory))
            except FileNotFoundError:
                pass
    return found


def modified_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:  # removed meanwhile (retention)
        return False


def data_files(world_size: int) -> set[str]:
    """The files of a whole checkpoint of ``world_size`` ranks, its manifest aside."""
    ranks = range(world_size)
    return {
        ".metadata", "metadata.json",
        *(f"__{r}_0.distcp" for r in ranks), *(f"rng/rank-{r:05d}.json" for r in ranks),
    }  # fmt: skip


def node_tiers(staging: list[Path]) -> list[Path]:
    """Each node's tiers: its staging directory and its memory tiers (where a save's local
    copy goes by default), in the memory root the job's processes were given."""
    return [*staging, *(t for s in staging for t in memory_tiers_of(s))]


def memory_tiers_of(staging: Path) -> list[Path]:
    """The memory tier directories whose owner records name ``staging`` (one per URL)."""
    from unbroken.checkpoint.memory_tier import OWNERS, default_root

    found = []
    for owners in Path(default_root()).glob(f"*/{OWNERS}"):
        for record in owners.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(record.read_text()).get("staging_dir") == os.path.realpath(staging):
                    found.append(owners.parent)
                    break
    return found


def save_phase(durable: Path, staging: list[Path], since: float, world_size: int) -> str:
    """What the save pipeline is doing now, judged from the files written since ``since``
    (the current attempt's start: what a killed attempt left is older and ignored)."""
    active: dict[int, tuple[set[str], list[set[str]]]] = {}
    for step, path in step_dirs(durable).items():
        active.setdefault(step, (set(), []))[0].update(fresh_files(path, since))
    for tier in node_tiers(staging):
        for step, path in step_dirs(tier).items():
            files = fresh_files(path, since)
            if files or modified_since(path, since):
                active.setdefault(step, (set(), []))[1].append(files)
    active = {s: v for s, v in active.items() if v[0] or v[1]}
    if not active:
        return "step"
    durable_files, staged = active[max(active)]
    if MANIFEST in durable_files:
        copies = [f for f in staged if f]
        return "commit" if any(MANIFEST not in f for f in copies) else "step"
    whole = {f for f in durable_files if TEMP_MARKER not in f}
    if data_files(world_size) <= whole:
        return "commit"
    return "upload" if durable_files else "staging"


def committed_steps(durable: Path) -> set[int]:
    return {s for s, p in step_dirs(durable).items() if (p / MANIFEST).exists()}


@dataclass
class Kill:
    """One SIGKILL and what the tiers held at that moment."""

    when: float
    phase: str
    committed: set[int]
    """Steps the durable tier held committed just before the kill."""


@dataclass
class CrashLog:
    """Every kill of a run and every restore the run's ranks announced."""

    kills: list[Kill] = field(default_factory=list)
    restores: list[tuple[int, int, str | None]] = field(default_factory=list)
    """(rank, step, tier) of each start after the first."""
    restart_seconds: list[float] = field(default_factory=list)
    """From each kill to every rank's start of the next attempt (restored, ready)."""
    helper_kills: int = 0
    """Save helpers killed mid-upload (no restart follows: that save fails)."""

    def phases(self) -> dict[str, int]:
        return {p: sum(k.phase == p for k in self.kills) for p in PHASES}


def kill_at_random_moments(
    agent: Agent,
    kills: int,
    rng: random.Random,
    *,
    durable: Path,
    staging: list[Path],
    steps: int,
    span: int,
    jitter: float,
    world_size: int = 2,
    moments: dict[int, str] | None = None,
) -> CrashLog:
    """Kill one rank of ``agent`` ``kills`` times. Each attempt (once every rank announced
    its start) first commits a step past the one it restored (so every kill loses work a
    restore must bring back), trains on to a random step at most ``span`` further, runs
    for a random fraction of ``jitter`` seconds more, and a random rank dies. The job must
    log every step (``--log-every 1``); each kill records the save phase it hit.

    ``moments`` names attempts whose kill is aimed (the others are random): "helper" also
    kills a rank's save helper mid-upload first (that save fails, the job goes on),
    "memory commit" kills the rank once a step is committed in the durable tier and not
    yet in the node's memory tier (the window of the node's commit)."""
    log, moments = CrashLog(), moments or {}
    for attempt in range(kills):
        line, restored = agent.wait_for_starts(world_size * (attempt + 1))
        agent.wait_until(
            lambda _, r=restored: True if max(committed_steps(durable), default=0) > r else None,
            f"a commit past step {restored}",
        )
        now = agent.last_step(after=line)
        if now >= steps - 1:
            break  # nothing left to interrupt
        started = agent.lines[line][0]
        moment = moments.get(attempt, "random")
        if moment == "helper":
            log.helper_kills += kill_a_helper(agent, rng, durable, staging, started, world_size)

        def kill_now(since: float = started) -> Kill | None:
            """Kill a random rank, recording what the tiers held; None if none was left."""
            phase = save_phase(durable, staging, since, world_size)
            committed = committed_steps(durable)
            if agent.proc.poll() is not None or not agent.kill_one_rank(rng):
                return None
            return Kill(time.time(), phase, committed)

        def in_node_commit(since: float = started) -> bool:
            return node_commit_pending(durable, staging, since) and (
                save_phase(durable, staging, since, world_size) == "commit"
            )

        if moment == "memory commit":
            kill = kill_in_node_commit(agent, in_node_commit, kill_now)
        else:
            agent.wait_for_step(rng.randint(now + 1, min(steps - 1, now + span)), line)
            time.sleep(rng.uniform(0.0, jitter))
            kill = kill_now()
        if kill is None:
            break  # the job had already finished
        log.kills.append(kill)
    return log


def kill_in_node_commit(
    agent: Agent,
    in_commit: Callable[[], bool],
    kill: Callable[[], Kill | None],
    timeout: float = 120,
) -> Kill | None:
    """Kill a rank inside a node's commit: the ranks are stopped once one is seen, and
    killed only if it is still under way (else they go on to the next save's)."""
    deadline = time.monotonic() + timeout
    while wait_for(agent, in_commit, timeout=max(0.0, deadline - time.monotonic())):
        with agent.frozen():
            if in_commit():  # else it ended before the ranks stopped: wait for the next
                return kill()
    return kill()


def wait_for(agent: Agent, found, timeout: float = 120) -> bool:
    """Poll ``found()`` every 2 ms (a commit's window is tens of ms) until it holds; False
    if the job ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.proc.poll() is None:
        if found():
            return True
        time.sleep(0.002)
    return False


def node_commit_pending(durable: Path, staging: list[Path], since: float) -> bool:
    """A step committed in the durable tier since ``since`` whose copy in a node's memory
    tier has no manifest yet: the node's commit is under way."""
    memory = node_tiers(staging)[len(staging) :]
    for step, path in step_dirs(durable).items():
        try:
            if os.stat(path / MANIFEST).st_mtime < since:
                continue
        except FileNotFoundError:
            continue
        for tier in memory:
            copy = tier / step_dir(step)
            if copy.is_dir() and not (copy / MANIFEST).exists():
                return True
    return False


def kill_a_helper(
    agent: Agent,
    rng: random.Random,
    durable: Path,
    staging: list[Path],
    since: float,
    world_size: int,
) -> int:
    """SIGKILL one rank's save helper while a save uploads; 1 if one was killed."""
    if not wait_for(agent, lambda: save_phase(durable, staging, since, world_size) == "upload"):
        return 0
    helpers = agent.helpers()
    if not helpers:
        return 0
    try:
        rng.choice(helpers).send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return 0
    return 1


def read_result(path: Path) -> dict:
    return json.loads(path.read_text())


def check_run(crashed: Agent, log: CrashLog, result: dict, reference: dict) -> None:
    """The crashed run matches the uninterrupted one, bit for bit, and every restore
    loaded a committed step no older than what was committed when the kill came."""
    starts = crashed.starts()
    world = len(reference["ranks"])
    assert len(starts) == world * (len(log.kills) + 1), (log, crashed.output)
    for k, kill in enumerate(log.kills):
        attempt = starts[world * (k + 1) : world * (k + 2)]
        steps = {step for _, _, step, _ in attempt}
        assert len(steps) == 1, f"ranks restored different steps: {attempt}"
        step = steps.pop()
        newest = max(kill.committed, default=0)
        assert step >= newest, f"kill {k} ({kill.phase}): restored {step}, {newest} committed"
        log.restores += [(rank, s, tier) for _, rank, s, tier in attempt]
        log.restart_seconds.append(max(t for t, *_ in attempt) - kill.when)
    uncommitted = [step for step, committed in crashed.restored if not committed]
    assert not uncommitted, f"restored steps without a commit record: {uncommitted}"
    for key in ("samples_sha256", "steps"):
        assert result[key] == reference[key], (key, result[key], reference[key])
    for rank, (got, want) in enumerate(zip(result["ranks"], reference["ranks"])):
        for key in ("weights_sha256", "optimizer_sha256"):
            assert got[key] == want[key], f"rank {rank}: {key} differs after {log.phases()}"
    for step, ids in result["samples"].items():  # the steps the last attempt ran
        assert ids == reference["samples"][step], f"step {step} trained on other samples"
        assert result["losses"][step] == reference["losses"][step], f"step {step} loss"
