"""Composable policies: when to take a snapshot, and which snapshots to keep.

Triggers compose with ``|`` (any) and ``&`` (all): ``every_versions(100) | every_seconds(600)``.
Retention rules compose the same way: ``keep_last(3) | keep_best(2, "reward")`` keeps the
union, ``&`` the intersection. The newest valid snapshot is always kept, whatever the rule.
A bad argument (a count below 1, a negative or non-finite interval, an unknown mode) is a
``ConfigError`` naming the policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eventlog.errors import ConfigError


@dataclass(frozen=True)
class Progress:
    """What a trigger sees: versions and time since the last snapshot."""

    versions_since: int
    seconds_since: float
    #: The newest sealed version (for ``Trigger.waits_for``).
    newest: int = 0


class Trigger:
    """Decides whether to snapshot now, and says what it waits for."""

    def __init__(self, test: Callable[[Progress], bool], text: str,
                 wants: Callable[[Progress], str] | None = None) -> None:
        self._test, self._text = test, text
        self._wants = wants or (lambda _p: text)

    def __call__(self, progress: Progress) -> bool:
        return self._test(progress)

    def waits_for(self, progress: Progress) -> str:
        """What must happen before it fires, e.g. ``version 300 or 120 s more``."""
        return self._wants(progress)

    def __or__(self, other: Trigger) -> Trigger:
        return Trigger(lambda p: self(p) or other(p), f"({self} | {other})",
                       lambda p: f"{self.waits_for(p)} or {other.waits_for(p)}")

    def __and__(self, other: Trigger) -> Trigger:
        return Trigger(lambda p: self(p) and other(p), f"({self} & {other})",
                       lambda p: f"({self.waits_for(p)}) and ({other.waits_for(p)})")

    def __repr__(self) -> str:
        return self._text


def _at_least(low: int, value: object, what: str) -> None:
    """Refuse ``value`` unless it is an int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} needs a whole number >= {low}, got {value!r}")


def every_versions(n: int) -> Trigger:
    """Snapshot once ``n`` versions were sealed since the last snapshot."""
    _at_least(1, n, "every_versions(n)")
    return Trigger(lambda p: p.versions_since >= n, f"every_versions({n})",
                   lambda p: f"version {p.newest - p.versions_since + n}")


def every_seconds(s: float) -> Trigger:
    """Snapshot once ``s`` seconds passed since the last one (and something changed)."""
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        raise ConfigError(f"every_seconds(s) needs a finite number of seconds >= 0, got {s!r}")

    def wants(p: Progress) -> str:
        more = f"{s - p.seconds_since:.0f} s more" if p.seconds_since < s else ""
        if p.versions_since > 0:
            return more
        return "a new version" + (f" and {more}" if more else "")

    return Trigger(lambda p: p.versions_since > 0 and p.seconds_since >= s, f"every_seconds({s})", wants)


@dataclass(frozen=True)
class SnapshotInfo:
    """What retention knows about one valid snapshot."""

    snapshot_id: str
    version: int
    step: int
    metrics: dict[str, float]


class Retention:
    """Chooses the snapshots to keep out of the valid ones."""

    def __init__(self, keep: Callable[[Sequence[SnapshotInfo]], set[str]], text: str) -> None:
        self._keep, self._text = keep, text

    def keep(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        """Ids to keep; always includes the newest snapshot."""
        ordered = sorted(snapshots, key=lambda s: s.version)
        kept = self._keep(ordered)
        if ordered:
            kept.add(ordered[-1].snapshot_id)
        return kept

    def __or__(self, other: Retention) -> Retention:
        return Retention(lambda s: self._keep(s) | other._keep(s), f"({self} | {other})")

    def __and__(self, other: Retention) -> Retention:
        return Retention(lambda s: self._keep(s) & other._keep(s), f"({self} & {other})")

    def __repr__(self) -> str:
        return self._text


def keep_last(n: int) -> Retention:
    """Keep the ``n`` newest snapshots (``0``: only the newest, which is always kept)."""
    _at_least(0, n, "keep_last(n)")
    return Retention(lambda s: {x.snapshot_id for x in s[-n:]} if n > 0 else set(), f"keep_last({n})")


def keep_best(k: int, metric: str, mode: str = "max") -> Retention:
    """Keep the ``k`` snapshots with the best ``metric`` (``mode``: max or min)."""
    _at_least(1, k, "keep_best(k)")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"keep_best(metric) needs a metric name, got {metric!r}")
    if mode not in ("max", "min"):
        raise ConfigError(f"keep_best(mode) must be 'max' or 'min', got {mode!r}")
    sign = -1.0 if mode == "max" else 1.0

    def keep(s: Sequence[SnapshotInfo]) -> set[str]:
        scored = [x for x in s if metric in x.metrics]
        scored.sort(key=lambda x: (sign * x.metrics[metric], -x.version))
        return {x.snapshot_id for x in scored[:k]}

    return Retention(keep, f"keep_best({k}, {metric!r}, {mode!r})")


def keep_every(steps: int) -> Retention:
    """Keep, for every multiple of ``steps``, the first snapshot at or after it."""
    _at_least(1, steps, "keep_every(steps)")

    def keep(s: Sequence[SnapshotInfo]) -> set[str]:
        kept: dict[int, SnapshotInfo] = {}
        for x in s:
            kept.setdefault(x.step // steps, x)
        return {x.snapshot_id for x in kept.values()}

    return Retention(keep, f"keep_every({steps})")


def keep_all() -> Retention:
    """Keep every snapshot."""
    return Retention(lambda s: {x.snapshot_id for x in s}, "keep_all()")
