"""What goodput recording costs the training loop, per step and per event.

Two figures, each with recording on and off, alternating (ABAB) so drift hits both:
- per step: a loop of tiny steps (a 64x64 matmul) calling ``mgr.maybe_save`` with no save
  due, so the manager's per-step path is all that differs;
- per event: the recorder calls themselves (``step``, the loader's ``note_data_wait``).

    PYTHONPATH=src python -m bench.goodput.recording_cost [--steps 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import unbroken as ub
from unbroken.goodput import recorder


def loop_seconds(root: str, steps: int, *, goodput: bool) -> float:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    state = {"w": a}
    with ub.CheckpointManager(
        f"{root}/ck-{goodput}-{time.monotonic_ns()}",
        staging_dir=f"{root}/st-{goodput}-{time.monotonic_ns()}",
        every_steps=None,
        goodput=goodput,
    ) as mgr:
        t0 = time.perf_counter()
        for step in range(steps):
            torch.mm(a, b)
            mgr.maybe_save(step, state)
        return time.perf_counter() - t0


def event_ns(rec: recorder.Recorder, n: int) -> tuple[float, float]:
    t0 = time.perf_counter_ns()
    for i in range(n):
        rec.step(i)
    step_ns = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for _ in range(n):
        recorder.note_data_wait(0.001)
    wait_ns = (time.perf_counter_ns() - t0) / n
    return step_ns, wait_ns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        loop_seconds(root, 2000, goodput=True)  # warm up both paths
        loop_seconds(root, 2000, goodput=False)
        on, off = [], []
        for _ in range(args.rounds):
            off.append(loop_seconds(root, args.steps, goodput=False) / args.steps)
            on.append(loop_seconds(root, args.steps, goodput=True) / args.steps)
        mgr = ub.CheckpointManager(f"{root}/ev", staging_dir=f"{root}/ev-st", every_steps=None)
        rec = recorder.current()
        assert isinstance(rec, recorder.Recorder)
        runs = [event_ns(rec, args.steps) for _ in range(args.rounds)]
        step_ns, wait_ns = min(r[0] for r in runs), min(r[1] for r in runs)
        mgr.close()
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"per step, maybe_save loop (median of {args.rounds} rounds x {args.steps} steps):")
    print(f"  recording off  {m_off * 1e6:8.2f} us/step")
    print(f"  recording on   {m_on * 1e6:8.2f} us/step")
    print(f"  ratio on/off   {m_on / m_off:8.3f}   (+{(m_on - m_off) * 1e6:.2f} us/step)")
    print(f"per event (recorder call from the loop, best of {args.rounds}):")
    print(f"  step event     {step_ns:8.0f} ns")
    print(f"  data wait      {wait_ns:8.0f} ns")


if __name__ == "__main__":
    main()
