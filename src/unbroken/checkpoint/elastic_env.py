"""torchrun's restart trap, caught from inside a worker.

On torch 2.13 a torchelastic agent shares its rendezvous TCP store with its workers
across restart rounds, and workers' keys carry no per-attempt prefix: a restarted rank
can read a peer's stale address and hang in gloo's connectFullMesh. Setting
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agent's environment gives each round a
store of its own. The agent tells its workers which it chose
(``TORCHELASTIC_USE_AGENT_STORE``), so a worker can say so before a restart hangs.

Only the c10d rendezvous (``--rdzv-backend c10d``, ``--standalone``, or a plain
single-node ``torchrun --nproc-per-node N``) reads that variable. The static one,
torchrun's default as soon as ``--rdzv-endpoint``, ``--master-port`` or several nodes
are given without ``--rdzv-backend``, always shares its store. Workers inherit the
agent's environment, so a worker that sees the variable set and still
``TORCHELASTIC_USE_AGENT_STORE=True`` was started by a static rendezvous.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

_warned = False

FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def restart_hazard(environ: Mapping[str, str]) -> str | None:
    """Why this worker's restarts may hang, or None (pure: reads only ``environ``)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None  # not launched by torchrun / torchelastic
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # the agent already gives each round its own store
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if restarts <= 0:
        return None  # no restart, nothing to hang
    if environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return (
            f"torchrun was started with --max-restarts {restarts} and {FIX}, but with the "
            "static rendezvous (--rdzv-endpoint, --master-addr/--master-port or --nnodes "
            f"without --rdzv-backend), which ignores {FIX}: every restart round shares the "
            "agent's store, and on torch 2.13 a restarted rank can read a peer's stale "
            "address there and hang. Add `--rdzv-backend c10d` (same endpoint; on several "
            "nodes also the same --rdzv-id on each), or launch with --max-restarts 0 and "
            "let the scheduler restart the whole job."
        )
    return (
        f"torchrun was started with --max-restarts {restarts} but without {FIX} in its "
        "environment: on torch 2.13 a restarted rank can read a peer's stale address "
        "from the shared rendezvous store and hang (gloo: 'connection refused', then "
        f"nothing). Launch it as `{FIX} torchrun ...` with the c10d rendezvous "
        "(`--rdzv-backend c10d` wherever --rdzv-endpoint is given: the static rendezvous "
        "ignores the variable) so every restart round gets its own store."
    )


def warn_if_restarts_may_hang(environ: Mapping[str, str]) -> None:
    """Warn once per process when :func:`restart_hazard` finds the trap."""
    global _warned
    why = restart_hazard(environ)
    if why is None or _warned:
        return
    _warned = True
    warnings.warn(why, RuntimeWarning, stacklevel=3)
