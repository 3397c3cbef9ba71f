"""Provenance for asynchronous RL: the stamp an actor attaches to each rollout, and the
record of the stamps a version's training steps consumed.

A ``Stamp`` names the policy a rollout was produced with: ``(run, version, digest)``, and the
``kind`` of digest it carries. ``"state"``: the seal's state digest of that version
(``CommitSealed.state_digest``, what a full-state ``Follower`` verified); ``"weights/<dtype>"``:
the digest of the version's cast weights in the run's weights stream (what a
``WeightsFollower`` verified). ``rewind verify`` checks each against the seal it names.

The learner's ``Recorder.commit(..., consumed=stamps)`` records them as the small state
``provenance`` (``rank<r>/provenance`` on a multi-rank run): ``{"version": v, "runs": {run:
[[version, kind, digest, count], ...]}}``, packed by ``statecodec``, deduplicated with
counts. The version it belongs to is part of it, so a small state carried unchanged to a
version without stamps (which writes nothing new) is never read as that version's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from eventlog import statecodec
from eventlog.errors import ConfigError, DecodeError

#: The small state a version's consumed stamps are recorded as (``rank<r>/`` before it on a
#: multi-rank run).
PROVENANCE = "provenance"
#: The kind of a stamp whose digest is a seal's state digest.
STATE = "state"
#: The kind of a stamp whose digest is a weights-stream seal's (``weights/<dtype>``).
WEIGHTS = "weights/"
_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")
_NAME = re.compile(rf"^(?:rank\d+/)?{PROVENANCE}$")


@dataclass(frozen=True)
class Stamp:
    """The policy a rollout was produced with: version ``version`` of run ``run``, whose
    digest of kind ``kind`` (``"state"`` or ``"weights/<dtype>"``) is ``digest`` (hex)."""

    run: str
    version: int
    digest: str
    kind: str = STATE

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ConfigError(f"bad stamp {self.to_wire()!r}: {problem}")

    def to_wire(self) -> list[Any]:
        """The stamp as a msgpack-able list ``[run, version, digest, kind]``."""
        return [self.run, self.version, self.digest, self.kind]

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> Stamp:
        """A stamp from ``to_wire``'s list; ``DecodeError`` naming ``where`` if it is not one."""
        if not isinstance(obj, list | tuple) or len(obj) != 4:
            raise DecodeError(f"{where}: a stamp is [run, version, digest, kind], got {obj!r:.80}")
        try:
            return cls(*obj)
        except ConfigError as exc:
            raise DecodeError(f"{where}: {exc}") from None

    def pack(self) -> bytes:
        """The stamp as msgpack bytes (to send it beside a rollout)."""
        return statecodec.pack(self.to_wire())

    @classmethod
    def unpack(cls, data: bytes, where: str = "stamp") -> Stamp:
        """A stamp from ``pack``'s bytes; ``DecodeError`` naming ``where`` if they are not one."""
        return cls.from_wire(statecodec.unpack(data, where), where)


def _problem(s: Stamp) -> str:
    """What is wrong with a stamp's fields ("" : nothing)."""
    if not isinstance(s.run, str) or not s.run:
        return "its run must be a non-empty string"
    if type(s.version) is not int or s.version < 1:
        return "its version must be an int >= 1"
    if not isinstance(s.digest, str) or not _HEX.match(s.digest):
        return "its digest must be lowercase hex"
    if not isinstance(s.kind, str) or not (s.kind == STATE or (s.kind.startswith(WEIGHTS)
                                                                and len(s.kind) > len(WEIGHTS))):
        return f"its kind must be {STATE!r} or '{WEIGHTS}<dtype>'"
    return ""


def is_provenance(name: str) -> bool:
    """Whether small state ``name`` records consumed stamps."""
    return bool(_NAME.match(name))


@dataclass(frozen=True)
class Consumed:
    """The stamps one version's steps consumed, each with how many rollouts carried it."""

    version: int
    stamps: tuple[tuple[Stamp, int], ...]


def pack_consumed(version: int, stamps: Iterable[Stamp]) -> bytes:
    """The small state that records ``stamps`` as consumed by ``version``'s steps."""
    counts = Counter(stamps)
    runs: dict[str, list[list[Any]]] = {}
    for s, n in sorted(counts.items(), key=lambda kv: (kv[0].run, kv[0].version, kv[0].kind, kv[0].digest)):
        runs.setdefault(s.run, []).append([s.version, s.kind, s.digest, n])
    return statecodec.pack({"version": version, "runs": runs})


def read_consumed(state: bytes, where: str) -> Consumed:
    """A provenance small state; ``DecodeError`` naming ``where`` if it is not one."""
    tree = statecodec.unpack(state, where)
    if not isinstance(tree, dict) or type(tree.get("version")) is not int \
            or not isinstance(tree.get("runs"), dict):
        raise DecodeError(f"{where}: a provenance state is {{version, runs}}, got {tree!r:.80}")
    out: list[tuple[Stamp, int]] = []
    for run, rows in tree["runs"].items():
        if not isinstance(rows, list):
            raise DecodeError(f"{where}: the stamps of run {run!r} are not a list")
        for row in rows:
            if not isinstance(row, list) or len(row) != 4 or type(row[3]) is not int or row[3] < 1:
                raise DecodeError(f"{where}: a stamp row is [version, kind, digest, count], got {row!r:.80}")
            out.append((Stamp.from_wire([run, row[0], row[2], row[1]], where), row[3]))
    return Consumed(tree["version"], tuple(out))
