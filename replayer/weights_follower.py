"""Dtype followers: actors that hold only the model, in the dtype they serve, and read only
the run's weights stream (``eventlog.weightstream``, written by ``replayer.publisher``).

Within ``max_lag`` versions a follower applies the new patches one version at a time; beyond
it (and at first) it syncs from the newest keyframe plus the patches after it. Before any
bit of a version reaches the model, the version is checked whole: every chunk decodes to the
bits its digest names, the chunk digests make up the seal's digest of the cast weights, and
a patch applies to the version the model holds. Then the chunks are written into the model's
own storage under ``lock``, so a reader inside ``reading()`` sees one whole version. Memory:
the model, one version's patch (a keyframe is streamed, chunk by chunk, twice: checked, then
applied) and fixed costs.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from eventlog import (
    ConfigError,
    IntegrityError,
    RunAddress,
    StateMismatchError,
    tensorcodec,
)
from eventlog.capture import flatten
from eventlog.events import TensorDelta
from eventlog.ports import WEIGHTS
from eventlog.provenance import WEIGHTS as WEIGHTS_KIND
from eventlog.weightcodec import DigestTable, serving_dtype, weights_digest
from eventlog.weightstream import PublishedVersion, WeightsStream, check_chain
from replayer.follower import FULL, INCREMENTAL, MODEL, NOOP, FollowResult, ModelFollower

Spec = tuple[str, tuple[int, ...]]


class WeightsFollower(ModelFollower):
    """Keeps ``model`` (its floating tensors in ``dtype``) at the newest version of the run's
    weights stream; poll it, or run ``follow()``. Readers hold ``reading()``; each poll
    reports the version to the coordinator, so ``rewind followers`` lists the follower."""

    def __init__(self, address: RunAddress | str, model: torch.nn.Module, *,
                 dtype: str | torch.dtype = torch.bfloat16, max_lag: int = 8,
                 name: str | None = None) -> None:
        if max_lag < 0:
            raise ConfigError(f"follower needs max_lag >= 0 (got {max_lag})")
        self.dtype, self.max_lag = serving_dtype(dtype), max_lag
        self._bits = _model_bits(model)
        super().__init__(address, model, name)
        self._specs: dict[str, Spec] = {}  # the stream's layout (from its keyframe)
        self._table: DigestTable = {}
        self._log = self.address.open_log()
        self._stream = WeightsStream(self._log)
        self._index: list[PublishedVersion] = []
        self._cursor: int | None = None  # the offset of the newest seal read
        self._digest = b""

    @property
    def digest(self) -> bytes:
        """The digest of the cast weights the model holds (empty: none yet)."""
        return self._digest

    def _poll_once(self, before: int, t0: float) -> FollowResult:
        try:
            self._read_index()
            latest = self._index[-1] if self._index else None
            if latest is None or latest.version <= before:
                return FollowResult(before, before, NOOP, 0, 0, time.perf_counter() - t0)
            return self._advance(before, latest, t0)
        finally:
            # Between polls an actor holds no read buffers (Kafka consumers prefetch).
            self._log.forget_reads(WEIGHTS)

    def _release(self) -> None:
        self._log.close()

    def _held_digest(self) -> tuple[str, bytes]:
        return WEIGHTS_KIND + self.dtype, self._digest

    # ------------------------------------------------------------------ internals
    def _read_index(self) -> None:
        """Add the versions sealed since the last read; forget those retention deleted."""
        new = self._stream.index(gt=self._cursor)
        if new:
            self._cursor = new[-1].seal_offset
        first = self._log.start_offset(WEIGHTS)
        self._index = [v for v in self._index if v.start + 1 >= first] + new
        for v in new:
            if v.dtype != self.dtype:
                raise ConfigError(f"{self._stream.where} is published in {v.dtype}, not {self.dtype} "
                                  f"(version {v.version}): follow it with dtype={v.dtype}")

    def _advance(self, before: int, latest: PublishedVersion, t0: float) -> FollowResult:
        patches, reason = self._patch_path(before, latest.version)
        if latest.version - before > self.max_lag:
            reason = f"lag {latest.version - before} > max_lag {self.max_lag}"
        if not reason:
            for v in patches:
                self._apply_patch(v)
            return FollowResult(before, self._version, INCREMENTAL, len(patches), 0,
                                time.perf_counter() - t0)
        keyframes = [i for i, v in enumerate(self._index) if v.keyframe]
        if not keyframes:
            raise IntegrityError(f"{self._stream.where} holds no keyframe to sync from "
                                 f"(versions {self._index[0].version}..{latest.version})")
        chain = self._index[keyframes[-1]:]
        check_chain(self._stream.where, chain)
        self._apply_keyframe(chain[0])
        for v in chain[1:]:
            self._apply_patch(v)
        return FollowResult(before, self._version, FULL, len(chain), 0, time.perf_counter() - t0,
                            reason)

    def _patch_path(self, before: int, target: int) -> tuple[list[PublishedVersion], str]:
        """The versions from ``before`` to ``target``, each a patch of the one before, or why
        they cannot be applied as patches (then a keyframe sync is needed)."""
        if before == 0:
            return [], "first sync"
        after = [v for v in self._index if before < v.version <= target]
        chain = [v for v in self._index if v.version == before][:1] + after
        if len(chain) != len(after) + 1:
            return [], f"retention deleted the patches after version {before}"
        keyframes = [v.version for v in after if v.keyframe]
        if keyframes:
            return [], f"version {keyframes[-1]} is a keyframe"
        check_chain(self._stream.where, chain)
        return after, ""

    def _check_chunk(self, delta: TensorDelta, v: PublishedVersion, specs: dict[str, Spec]) -> None:
        """Fail unless ``delta`` is a chunk of a tensor the model holds, as the stream names it."""
        spec = specs.get(delta.name)
        if spec is None or spec != (delta.dtype, tuple(delta.shape)) \
                or delta.chunk_count != len(self._table[delta.name]):
            raise IntegrityError(
                f"{self._stream.where}, version {v.version}: chunk of {delta.name!r} "
                f"{delta.dtype}{list(delta.shape)}, which the stream's keyframe names "
                f"{'nowhere' if spec is None else f'{spec[0]}{list(spec[1])}'} "
                f"(chunk {delta.chunk_index} of {delta.chunk_count})")
        tensorcodec.check_result(delta, self._bits[delta.name], f"{self._stream.where}, version {v.version}")

    def _apply_keyframe(self, v: PublishedVersion) -> None:
        """Check the whole keyframe (a first pass), then write it into the model (a second)."""
        where = f"{self._stream.where}, keyframe of version {v.version}"
        layout: dict[str, Spec] = {}
        table: dict[str, dict[int, bytes]] = {}
        counts: dict[str, int] = {}
        for delta in self._stream.chunks(v):
            spec = (delta.dtype, tuple(delta.shape))
            if layout.setdefault(delta.name, spec) != spec or delta.encoding != TensorDelta.FULL:
                raise IntegrityError(f"{where}: damaged chunk {delta.chunk_index} of {delta.name!r}")
            table.setdefault(delta.name, {})[delta.chunk_index] = delta.digest
            counts[delta.name] = delta.chunk_count
        self._fit(layout)
        missing = [n for n in layout if len(table[n]) != counts[n]]
        if missing:
            raise IntegrityError(f"{where}: chunks of {missing[0]!r} are missing")
        full = {n: [table[n][i] for i in range(counts[n])] for n in layout}
        if weights_digest(layout, full) != v.digest:
            raise IntegrityError(f"{where}: its chunks do not make up the digest of its seal")
        for delta in self._stream.chunks(v):  # every chunk's bits against its digest
            tensorcodec.check_result(delta, self._bits[delta.name], where)
        with self.lock:
            self._version = 0  # a failure while writing leaves no version claimed
            for delta in self._stream.chunks(v):
                tensorcodec.decode_chunk(delta, self._bits[delta.name], where)
            self._specs, self._table = layout, full
            self._version, self._digest = v.version, v.digest

    def _apply_patch(self, v: PublishedVersion) -> None:
        """Check one patch whole against the seal, then write it into the model."""
        where = f"{self._stream.where}, patch of version {v.version}"
        chunks = list(self._stream.chunks(v))
        table = dict(self._table)
        for delta in chunks:
            self._check_chunk(delta, v, self._specs)
            if table[delta.name] is self._table[delta.name]:
                table[delta.name] = list(table[delta.name])
            table[delta.name][delta.chunk_index] = delta.digest
        if weights_digest(self._specs, table) != v.digest:
            raise IntegrityError(f"{where}: its chunks do not make up the digest of its seal "
                                 f"(a chunk is damaged or missing)")
        with self.lock:
            for delta in chunks:
                tensorcodec.decode_chunk(delta, self._bits[delta.name], where, verify=False)
            self._table, self._version, self._digest = table, v.version, v.digest

    def _fit(self, layout: dict[str, Spec]) -> None:
        """Fail unless the model's tensors are the stream's, by name, dtype and shape."""
        live = {k: (tensorcodec.dtype_name(t.dtype), tuple(t.shape)) for k, t in self._bits_tensors.items()}
        problems = [f"missing in the model: {k}" for k in sorted(layout.keys() - live.keys())]
        problems += [f"not in the stream: {k}" for k in sorted(live.keys() - layout.keys())
                     if self._bits_tensors[k].numel()]
        problems += [f"{k}: stream has {layout[k][0]}{list(layout[k][1])}, model has "
                     f"{live[k][0]}{list(live[k][1])}" for k in sorted(layout.keys() & live.keys())
                     if layout[k] != live[k]]
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise StateMismatchError(f"the actor model does not match {self._stream.where}: {shown}")

    @property
    def _bits_tensors(self) -> dict[str, torch.Tensor]:
        prefix = f"{MODEL}/"
        return {k.removeprefix(prefix): t for k, t in flatten(MODEL, self.model.state_dict())[0].items()}


def _model_bits(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A writable uint8 view of each tensor the model records (tied ones once), by state key."""
    prefix = f"{MODEL}/"
    out = {}
    for key, t in flatten(MODEL, model.state_dict())[0].items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ConfigError(f"a weights follower writes into the model's memory: "
                              f"{key.removeprefix(prefix)} must be a contiguous CPU tensor "
                              f"(it is {t.device}, "
                              f"{'contiguous' if t.is_contiguous() else 'strided'})")
        out[key.removeprefix(prefix)] = tensorcodec.tensor_bits(t)
    return out
