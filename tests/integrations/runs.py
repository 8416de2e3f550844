"""What the integration jobs print, read back: restores, steps, samples seen, digests.

A job (``_hf_job.py``, ``_lightning_job.py``) prints per rank ``RESTORED rank attempt
step`` once its restore ran, ``STEP rank attempt step`` before each step's save,
``SEEN rank attempt step [ids]`` for each step's batch and ``DONE rank attempt digest`` at
the end. Lines of two ranks may run into each other, so they are found anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class Run:
    """One torchrun launch's output, parsed."""

    text: str

    def restored(self, rank: int, attempt: int) -> int:
        hits = re.findall(rf"RESTORED {rank} {attempt} (\d+)", self.text)
        assert len(hits) == 1, (rank, attempt, self.text[-5000:])
        return int(hits[0])

    def last_step(self, rank: int, attempt: int) -> int:
        hits = re.findall(rf"STEP {rank} {attempt} (\d+)", self.text)
        assert hits, (rank, attempt, self.text[-5000:])
        return int(hits[-1])

    def trajectory(self, rank: int) -> dict[int, list[int]]:
        """Step -> the sample ids of its batch, the last attempt's where steps were redone:
        the samples the final weights were trained on."""
        seen: dict[int, list[int]] = {}
        for m in re.finditer(rf"SEEN {rank} \d+ (\d+) \[([\d, ]*)\]", self.text):
            seen[int(m[1])] = [int(i) for i in m[2].split(",") if i.strip()]
        return seen

    def digests(self) -> set[str]:
        return set(re.findall(r"DONE \d+ \d+ ([0-9a-f]{64})", self.text))


def each_sample_once_per_epoch(run: Run, ranks: int, steps_per_epoch: int, files: int) -> None:
    """Every whole epoch of the final trajectory holds every file once, across ranks."""
    paths = [run.trajectory(r) for r in range(ranks)]
    last = max(paths[0])
    for start in range(1, last + 1, steps_per_epoch):
        steps = range(start, start + steps_per_epoch)
        if steps[-1] > last:
            ids = [i for p in paths for s in steps if s in p for i in p[s]]
            assert len(ids) == len(set(ids)), f"epoch from step {start}: a sample twice"
            return
        ids = sorted(i for p in paths for s in steps for i in p[s])
        assert ids == list(range(files)), f"epoch from step {start}: {ids}"
