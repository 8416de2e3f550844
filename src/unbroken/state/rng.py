"""Capture and restore every RNG stream that shapes training, as a JSON-able dict.

Exact resume needs the same dropout masks, augmentations and shuffles after a restart, so
the calling process's python ``random``, numpy's global generator, torch's CPU generator
and (when CUDA is in use) every CUDA device's generator go into the checkpoint, with the
``torch.Generator`` objects of the user's state: like the global streams, each rank's own
(seeded ``100 + rank``, say) is per rank, so it travels in the rank's record. Byte
states are base64 text so the record is plain JSON: loading it never unpickles anything.

``restore_rng_state`` checks the whole record before touching any generator: a malformed
record raises ``RngStateError`` naming the bad key and changes nothing. A restore that
must check everything before it changes anything (a checkpoint's) decodes the record
first (``decode_rng_state``) and applies it later (``apply_rng_state``), which then has
nothing left that can fail.
"""

from __future__ import annotations

import base64
import binascii
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FORMAT = 1
_MT_WORDS = 624  # Mersenne Twister state words, for python random and numpy alike
_PYTHON_VERSION = 3  # what random.getstate() writes and random.setstate() takes
_CUDA_STATE_BYTES = (8, 16)  # a CUDA generator's seed, and its offset (which may be absent)

__all__ = [
    "RngState",
    "RngStateError",
    "apply_rng_state",
    "capture_rng_state",
    "decode_rng_state",
    "generator_state",
    "restore_rng_state",
    "set_generator_state",
]


class RngStateError(ValueError):
    """A saved RNG record is malformed; the message names the key."""


@dataclass(frozen=True)
class RngState:
    """A record checked and decoded: each generator's state as its setter takes it."""

    python: tuple
    numpy: tuple
    cpu: torch.Tensor
    cuda: list[torch.Tensor]
    generators: dict[str, torch.Tensor] = field(default_factory=dict)
    """The state's own ``torch.Generator`` entries, by entry name (applied by the restore,
    which holds the objects)."""


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The calling process's RNG states: python, numpy, torch CPU, and CUDA when in use,
    and each of ``generators`` (the state's own) by name.

    CUDA states are captured only once CUDA is initialized: before that every device is at
    its default seed, and capturing would create a context on every GPU.
    """
    version, internal, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "format": FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "key": _b64(np.asarray(key, dtype="<u4").tobytes()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(t.numpy().tobytes()) for t in torch.cuda.get_rng_state_all()]
    if generators:
        state["generators"] = {name: generator_state(g) for name, g in generators.items()}
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put every generator back where ``capture_rng_state`` found it.

    Raises ``RngStateError`` naming the missing or bad key (nothing is changed then).
    CUDA states are restored for the devices present; a different device count warns.
    """
    apply_rng_state(decode_rng_state(state))


def apply_rng_state(state: RngState) -> None:
    """Set every generator from a decoded record (see ``restore_rng_state``)."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    cuda = state.cuda
    if not cuda:
        return
    if not torch.cuda.is_available():
        warnings.warn(
            f"rng state holds {len(cuda)} CUDA generator state(s) but CUDA is not available "
            "here; they are not restored",
            stacklevel=2,
        )
        return
    count = torch.cuda.device_count()
    if count != len(cuda):
        warnings.warn(
            f"rng state holds {len(cuda)} CUDA generator state(s) but {count} device(s) are "
            f"visible; restoring the first {min(count, len(cuda))}",
            stacklevel=2,
        )
    for device, saved in enumerate(cuda[:count]):
        torch.cuda.set_rng_state(saved, device)


def generator_state(generator: torch.Generator) -> str:
    """One ``torch.Generator``'s state as base64 text (e.g. a data loader's own generator)."""
    return _b64(generator.get_state().numpy().tobytes())


def set_generator_state(generator: torch.Generator, state: str, *, key: str = "generator") -> None:
    """Restore a state from ``generator_state``; ``key`` names it in errors."""
    data = _bytes_tensor(state, key)
    expected = generator.get_state().numel()
    if data.numel() != expected:
        raise RngStateError(
            f"rng state {key!r}: {data.numel()} bytes, but a {generator.device} generator's "
            f"state has {expected}"
        )
    generator.set_state(data)


def decode_rng_state(state: Mapping[str, Any]) -> RngState:
    """Every part of a ``capture_rng_state`` record, checked and decoded, touching no
    generator: whatever the setters would refuse raises ``RngStateError`` here."""
    if not isinstance(state, Mapping):
        raise RngStateError(f"rng state must be a dict, got {type(state).__name__}")
    fmt = _field(state, "format", int)
    if fmt != FORMAT:
        raise RngStateError(f"rng state 'format' is {fmt}, this version reads {FORMAT}")

    py = _field(state, "python", Mapping)
    version = _field(py, "version", int, "python.")
    if version != _PYTHON_VERSION:
        raise RngStateError(
            f"rng state 'python.version' is {version}, python's random reads {_PYTHON_VERSION}"
        )
    internal = _field(py, "internal", list, "python.")
    if len(internal) != _MT_WORDS + 1 or not all(_is_u32(v) for v in internal):
        raise RngStateError(
            f"rng state 'python.internal' must be {_MT_WORDS + 1} integers in [0, 2**32)"
        )
    if internal[-1] > _MT_WORDS:  # the position in the state, last
        raise RngStateError(
            f"rng state 'python.internal' ends in position {internal[-1]}, outside [0, {_MT_WORDS}]"
        )
    gauss_next = _field(py, "gauss_next", (float, int, type(None)), "python.")

    npy = _field(state, "numpy", Mapping)
    kind = _field(npy, "kind", str, "numpy.")
    if kind != "MT19937":
        raise RngStateError(f"rng state 'numpy.kind' is {kind!r}, expected 'MT19937'")
    raw = _b64_bytes(_field(npy, "key", str, "numpy."), "numpy.key")
    if len(raw) != 4 * _MT_WORDS:
        raise RngStateError(f"rng state 'numpy.key' must decode to {4 * _MT_WORDS} bytes")
    key = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    pos = _field(npy, "pos", int, "numpy.")
    if not 0 <= pos <= _MT_WORDS:
        raise RngStateError(f"rng state 'numpy.pos' is {pos}, outside [0, {_MT_WORDS}]")
    has_gauss = _field(npy, "has_gauss", int, "numpy.")
    if has_gauss not in (0, 1):
        raise RngStateError(f"rng state 'numpy.has_gauss' is {has_gauss}, not 0 or 1")
    numpy_state = (
        kind,
        key,
        pos,
        has_gauss,
        float(_field(npy, "cached_gaussian", (float, int), "numpy.")),
    )

    cpu = _bytes_tensor(_field(state, "torch", str), "torch")
    expected = torch.get_rng_state().numel()
    if cpu.numel() != expected:
        raise RngStateError(f"rng state 'torch': {cpu.numel()} bytes, expected {expected}")
    cuda_list = _field(state, "cuda", list)
    cuda = [_bytes_tensor(v, f"cuda.{i}") for i, v in enumerate(cuda_list)]
    for i, device_state in enumerate(cuda):
        # Checked here: torch applies a CUDA state lazily, at CUDA's first use, where a
        # refusal would come far from the restore.
        if device_state.numel() not in _CUDA_STATE_BYTES:
            raise RngStateError(
                f"rng state 'cuda.{i}': {device_state.numel()} bytes, a CUDA generator's "
                f"state has {' or '.join(map(str, _CUDA_STATE_BYTES))}"
            )
    saved = state.get("generators", {})
    if not isinstance(saved, Mapping):
        raise RngStateError("rng state key 'generators' must be a dict")
    generators = {
        str(name): _bytes_tensor(text, f"generators.{name}") for name, text in saved.items()
    }
    return RngState((version, tuple(internal), gauss_next), numpy_state, cpu, cuda, generators)


def _field(record: Mapping[str, Any], name: str, kind: type | tuple, prefix: str = "") -> Any:
    if not isinstance(record, Mapping):
        raise RngStateError(f"rng state {prefix.rstrip('.')!r} must be a dict")
    if name not in record:
        raise RngStateError(f"rng state is missing key {prefix + name!r}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise RngStateError(
            f"rng state key {prefix + name!r} must be {names}, got {type(value).__name__}"
        )
    return value


def _is_u32(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64_bytes(text: object, key: str) -> bytes:
    if not isinstance(text, str):
        raise RngStateError(f"rng state key {key!r} must be base64 text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise RngStateError(f"rng state key {key!r} is not valid base64: {exc}") from None


def _bytes_tensor(text: object, key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_b64_bytes(text, key)), dtype=torch.uint8)
