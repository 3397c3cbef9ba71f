"""Whether two runs' states at a common step differ, decided without replaying a tensor.

A seal's state digest covers its shard digests and its small-state digest. Equal state
digests: the states are equal. Different shard digests: the tensors differ (or their layout
does). Only the small-state digests differ: the digest covers the encoded bytes, which
differ for equal values (a dict whose keys came back in another order after a resume), so
the small states are decoded and compared as values (``replayer.statediff``), the current
ranks' only (``replayer.globalview.live_states``). For that, each run's control partition is
folded once, version by version, the first time a step needs it; each version keeps two
digests of its small states, measurements left out and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from eventlog import RunAddress, statecodec
from eventlog.fold.engine import ControlIndex, SealInfo, SmallStates, fold_control
from replayer import statediff
from replayer.assemble import recorded_world
from replayer.globalview import live_states


@dataclass(frozen=True)
class Decoded:
    """A version's small states as values: digests without and with the measurements."""

    loose: bytes
    strict: bytes


class StepComparison:
    """Compares the two runs' seals at each common step (``pairs[i]``: A's and B's)."""

    def __init__(self, runs: tuple[RunAddress, RunAddress], indexes: tuple[ControlIndex, ControlIndex],
                 pairs: Sequence[tuple[SealInfo, SealInfo]], *, strict: bool,
                 on_phase: Callable[[str], None]) -> None:
        self.runs, self.indexes, self.pairs, self.strict = runs, indexes, pairs, strict
        self._phase = on_phase
        self._decoded: tuple[dict[int, Decoded], dict[int, Decoded]] | None = None

    def _undecided(self, i: int) -> bool:
        """Whether the seals alone cannot tell: only their small-state digests differ."""
        sa, sb = self.pairs[i][0].seal, self.pairs[i][1].seal
        return (sa.state_digest != sb.state_digest and list(sa.shard_digests) == list(sb.shard_digests)
                and sa.small_digest != sb.small_digest)

    def decoded(self, i: int) -> tuple[Decoded, Decoded]:
        """Step ``i``'s small states as values, in A and in B (only for a step the seals
        leave undecided)."""
        if self._decoded is None:
            self._phase("comparing small states as values")
            wanted = [i for i in range(len(self.pairs)) if self._undecided(i)]
            self._decoded = (
                decoded_versions(self.runs[0], self.indexes[0], {self.pairs[i][0].version for i in wanted}),
                decoded_versions(self.runs[1], self.indexes[1], {self.pairs[i][1].version for i in wanted}))
        sa, sb = self.pairs[i]
        return self._decoded[0][sa.version], self._decoded[1][sb.version]

    def differs(self, i: int) -> bool:
        """Whether the states at step ``i`` differ (measurements count only if ``strict``)."""
        sa, sb = self.pairs[i][0].seal, self.pairs[i][1].seal
        if sa.state_digest == sb.state_digest:
            return False
        if not self._undecided(i):
            return True
        da, db = self.decoded(i)
        return (da.strict != db.strict) if self.strict else (da.loose != db.loose)

    def measured_only(self, i: int) -> bool:
        """Whether the states at step ``i`` differ only in their measurements."""
        if self.strict or not self._undecided(i):
            return False
        da, db = self.decoded(i)
        return da.loose == db.loose and da.strict != db.strict

    def encoding_only(self, i: int) -> bool:
        """Whether the small states at step ``i`` differ only as bytes: equal as values."""
        if not self._undecided(i):
            return False
        da, db = self.decoded(i)
        return da.strict == db.strict


def decoded_versions(address: RunAddress, idx: ControlIndex, versions: set[int]) -> dict[int, Decoded]:
    """The decoded small-state digests of ``versions``: one fold of the control partition,
    on from each version to the next, as a replay folds on from a base."""
    out: dict[int, Decoded] = {}
    if not versions:
        return out
    known: dict[str, tuple[bytes, Decoded]] = {}  # a state's bytes are decoded once
    state = SmallStates()
    last = max(versions)
    with address.open_log() as log:
        for v in sorted(idx.seals):
            if v > last:
                break
            fold_control(log, idx, v, state, state.folded_to)
            if v in versions:
                names = {t.name for t in idx.layout_at(v).tensors}
                out[v] = _combined(live_states(state.states, recorded_world(state.states, names)), known)
    return out


def _combined(states: dict[str, bytes], known: dict[str, tuple[bytes, Decoded]]) -> Decoded:
    loose, strict = xxhash.xxh3_128(), xxhash.xxh3_128()
    for name in sorted(states):
        raw = states[name]
        if name not in known or known[name][0] != raw:
            tree = statecodec.unpack(raw, f"small state {name!r}")
            known[name] = raw, Decoded(statediff.state_digest(tree),
                                       statediff.state_digest(tree, strict=True))
        d = known[name][1]
        for h, part in ((loose, d.loose), (strict, d.strict)):
            h.update(name.encode() + b"\0")
            h.update(part)
    return Decoded(loose.digest(), strict.digest())
