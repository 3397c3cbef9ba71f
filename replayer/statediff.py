"""Small states compared as decoded values, not as encoded bytes.

Two small states are equal when their decoded trees are: dicts whatever their key order,
lists and tuples element by element (a tuple never equals a list), floats by their bits (so
``nan`` equals itself and ``-0.0`` differs from ``0.0``), arrays and tensors by dtype, shape
and bits. ``state_digest`` hashes a tree that way, so one digest per state decides equality.

**Measurements** are fields that measure a run instead of driving it: a value read from the
wall clock, or a count of the compute done, that a restore does not feed back into what
training computes (no tensor, RNG draw or data order depends on it). Two runs that trained
identically still differ there (a run started a second later, a resumed run that took up
its compute count from the last log), so they are compared apart and, unless ``strict``,
do not make states differ. They are the fields of ``MEASUREMENTS``, each known by the
record that holds it:

* Stable-Baselines3's ``Monitor`` wrapper (a dict that also holds ``episode_returns``):
  ``t_start``, the wall-clock time it started, and ``episode_times``, each episode's end
  time since then;
* an SB3 episode record (``{"r": return, "l": length, "t": ...}``, in the episode-info
  buffer and in the env's last infos): ``t``, seconds since its ``Monitor`` started;
* Hugging Face's ``TrainerState`` (a dict that also holds ``global_step`` and
  ``max_steps``): ``total_flos``, the floating-point operations counted so far, which the
  trainer adds up at each log, so a resumed run lacks what it counted since the last log.

A clock that does feed back is training state and is always compared: Lightning's
``Timer`` callback, whose elapsed time decides when training stops, is not a measurement.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from eventlog import statecodec
from eventlog.statecodec import TensorRef


@dataclass(frozen=True)
class Measurement:
    """Measurement fields, in a dict that holds every key of ``marks`` (``fields`` included)."""

    what: str
    marks: frozenset[str]
    fields: frozenset[str]


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("SB3 Monitor", frozenset({"t_start", "episode_times", "episode_returns"}),
                frozenset({"t_start", "episode_times"})),
    Measurement("SB3 episode record", frozenset({"r", "l", "t"}), frozenset({"t"})),
    Measurement("HF TrainerState", frozenset({"total_flos", "global_step", "max_steps"}),
                frozenset({"total_flos"})),
)
#: Paths listed per differing state; the rest are counted.
MAX_PATHS = 12


def measured_keys(node: Mapping[Any, Any]) -> frozenset[str]:
    """The keys of ``node`` that are measurements (see the module docstring)."""
    found: frozenset[str] = frozenset()
    for m in MEASUREMENTS:
        if m.marks <= node.keys():
            found |= m.fields
    return found


def _key_order(key: Any) -> tuple[str, str]:
    return type(key).__name__, repr(key)


def _leaf(value: Any) -> bytes:
    """A leaf's identity: its type and exact value (floats, arrays and tensors by bits)."""
    if value is None or isinstance(value, bool):
        return repr(value).encode()
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, float):
        return b"f" + struct.pack("<d", value)
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, np.ndarray):
        return f"a{value.dtype.str}{list(value.shape)}".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1)
        return f"t{value.dtype}{list(value.shape)}".encode() + flat.view(torch.uint8).numpy().tobytes()
    if isinstance(value, TensorRef):
        return b"r" + value.name.encode()
    return f"{type(value).__name__}:{value!r}".encode()


def _feed(h: Any, node: Any, strict: bool) -> None:
    if isinstance(node, dict):
        skip = frozenset() if strict else measured_keys(node)
        keys = sorted((k for k in node if k not in skip), key=_key_order)
        h.update(b"{%d:" % len(keys))
        for k in keys:
            _feed(h, k, strict)
            _feed(h, node[k], strict)
        h.update(b"}")
    elif isinstance(node, list | tuple):
        h.update(b"%s%d:" % (b"(" if isinstance(node, tuple) else b"[", len(node)))
        for v in node:
            _feed(h, v, strict)
        h.update(b"]")
    else:
        leaf = _leaf(node)
        h.update(b"%d:" % len(leaf))
        h.update(leaf)


def state_digest(tree: Any, *, strict: bool = False) -> bytes:
    """A digest of a decoded state that two trees share exactly when they are equal as
    values (see the module docstring); measurements are left out unless ``strict``."""
    h = xxhash.xxh3_128()
    _feed(h, tree, strict)
    return h.digest()


@dataclass
class TreeDiff:
    """Where two decoded states differ: ``path: A's -> B's`` (``path: differs (N elements)``
    for arrays and tensors), the training state's and the measurements' apart."""

    paths: list[str]
    measured: list[str]


def tree_diff(x: Any, y: Any, *, strict: bool = False) -> TreeDiff:
    """Each leaf where ``x`` and ``y`` differ as values (measurements apart unless ``strict``)."""
    out = TreeDiff([], [])
    _walk(x, y, "", out.paths, out.measured, strict)
    out.paths = [p.removeprefix(".") for p in out.paths]
    out.measured = [p.removeprefix(".") for p in out.measured]
    return out


def _walk(x: Any, y: Any, path: str, out: list[str], measured: list[str], strict: bool) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
        skip = frozenset() if strict else measured_keys(x) | measured_keys(y)
        for k in sorted(x.keys() | y.keys(), key=_key_order):
            into = measured if k in skip else out
            if k not in x or k not in y:
                into.append(f"{path}.{k}: only in {'A' if k in x else 'B'}")
            else:
                _walk(x[k], y[k], f"{path}.{k}", into, measured, strict)
        return
    if isinstance(x, list | tuple) and type(x) is type(y) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _walk(u, v, f"{path}[{i}]", out, measured, strict)
        return
    if _leaf(x) == _leaf(y):
        return
    if isinstance(x, np.ndarray | torch.Tensor) and type(x) is type(y):
        size = x.size if isinstance(x, np.ndarray) else x.numel()
        out.append(f"{path}: differs ({size} elements)")
    else:
        out.append(f"{path}: {short_repr(x)} -> {short_repr(y)}")


def short_repr(value: Any) -> str:
    """``repr(value)``, or its type and length when that is long."""
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} of {len(text)} chars"


def states_diff(name: str, a: bytes, b: bytes, *, strict: bool = False) -> TreeDiff:
    """Decode small state ``name`` of both runs and compare it (see ``tree_diff``)."""
    return tree_diff(statecodec.unpack(a, f"A's small state {name!r}"),
                     statecodec.unpack(b, f"B's small state {name!r}"), strict=strict)


_INDEX = re.compile(r"\[\d+\]")


def grouped(paths: list[str]) -> list[str]:
    """``paths`` with the list indexes that vary folded: ``a[3].t: 1.0 -> 2.0`` and
    ``a[4].t: ...`` become ``a[*].t (2 values)``; a path alone in its group is kept whole."""
    groups: dict[str, list[str]] = {}
    for p in paths:
        groups.setdefault(_INDEX.sub("[*]", p.split(": ", 1)[0]), []).append(p.split(": ", 1)[0])
    out = []
    for key, members in groups.items():
        if len(members) == 1:
            out.append(next(p for p in paths if p.split(": ", 1)[0] == members[0]))
            continue
        indexes = [_INDEX.findall(m) for m in members]
        parts = key.split("[*]")
        shown = parts[0] + "".join((idx if all(ix[k] == idx for ix in indexes) else "[*]") + part
                                   for k, (idx, part) in enumerate(zip(indexes[0], parts[1:], strict=True)))
        out.append(f"{shown} ({len(members)} values)")
    return out
