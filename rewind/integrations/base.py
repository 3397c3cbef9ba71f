"""What the framework callbacks share: their arguments, the rule for when a commit is
due, the recorder they build from those arguments, and the restore's result.

Each callback (``sb3``, ``hf`` and its ``trl`` subclass, ``lightning``) is its host library's
callback class and also a ``RunRecording``; it calls it from its own hooks. The arguments, the
same for all (``torchrl``'s loop adapter takes the same names):

* ``run``: a ``RunAddress`` or a run id (``REWIND_LOG`` names the backend, as for ``Recorder``);
* ``every``: the interval, in the adapter's unit (``Cadence``);
* ``extra``: more ``Stateful`` objects to record (a target network, a normalizer, a data
  collator); their tensors go to the tensor shards like the model's;
* ``snapshots``, ``settings``, ``predictive``: passed to the ``Recorder``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Self

from eventlog.backends import RunAddress
from eventlog.capture import Stateful
from eventlog.errors import ConfigError
from eventlog.settings import Settings
from rewind.recorder import Recorder
from rewind.results import CommitResult, RestoreResult
from rewind.snapshots import Snapshots, with_store
from snapshotter.policies import Trigger


class Cadence:
    """When a commit is due: at the first commit point at or after each multiple of ``every``
    units. A multiple that falls where the framework's state is not whole (a commit point is
    where it is) stays due until the next commit point; the schedule stays on the multiples
    (``every=4``, commit points everywhere but at 8: commits at 4, 9, 12).

    ``reset(at)`` says where counting starts (a resume: the restored version's count)."""

    def __init__(self, every: int, owner: str, unit: str) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{owner}(every={every!r}): commit every 1 or more {unit}")
        self.every = every
        self._last = 0

    def reset(self, at: int) -> None:
        """Count from ``at``: the next commit is due at the first multiple after it."""
        self._last = at

    def due(self, at: int) -> bool:
        """True when a multiple of ``every`` lies in ``(last commit, at]``."""
        return at // self.every > self._last // self.every

    def committed(self, at: int) -> None:
        """A commit was made (or found not needed) at ``at``."""
        self._last = at


class RunRecording:
    """An adapter's recorder, built from the arguments every adapter takes (module docs),
    and what its restore found (``restored``). A mixin beside the host library's callback
    class: the adapter's ``__init__`` calls ``_init_recording`` (no ``__init__`` here, so the
    host's cooperative ``super().__init__()`` chain is left alone)."""

    #: The adapter's name in errors, and the unit of ``every``.
    owner = "RewindCallback"
    unit = "steps"

    def _init_recording(
        self,
        run: RunAddress | str,
        every: int,
        extra: Mapping[str, Stateful] | None,
        snapshots: Snapshots | Trigger | None,
        settings: Settings | None,
        predictive: bool,
        own: Iterable[str] = (),
    ) -> None:
        self.cadence = Cadence(every, self.owner, self.unit)
        clash = sorted(set(extra or {}) & set(own))
        if clash:
            raise ConfigError(f"{self.owner}(extra=...): state name {clash[0]!r} is the callback's own")
        bad = sorted(n for n, o in (extra or {}).items() if not isinstance(o, Stateful))
        if bad:
            raise ConfigError(f"{self.owner}(extra=...): {bad[0]!r} has no state_dict/load_state_dict")
        self.run = run
        self._snapshots = None if snapshots is None else Snapshots.of(snapshots)
        self._settings = settings
        self._predictive = predictive
        self._extra = dict(extra or {})
        self._recorder: Recorder | None = None
        #: What the restore found (``None`` until the run was restored; ``fresh``: a new run).
        self.restored: RestoreResult | None = None

    @property
    def every(self) -> int:
        """The interval, in the adapter's unit."""
        return self.cadence.every

    @property
    def recorder(self) -> Recorder | None:
        """The recorder (``None`` before training binds it, and once it is closed)."""
        return self._recorder

    def _address(self) -> RunAddress:
        """The run's address (the snapshots' store included)."""
        address = self.run if isinstance(self.run, RunAddress) else RunAddress.from_env(self.run)
        return address if self._snapshots is None else with_store(address, self._snapshots)

    def _open(self, own: Mapping[str, Stateful], extra: Mapping[str, Stateful] | None = None,
              **objects: Any) -> Recorder:
        """Build the recorder: ``objects`` (the framework's model, optimizer, ...) and the
        user's ``extra`` (or the adapter's stand-ins for them) with their tensors in the
        shards, the adapter's ``own`` states whole."""
        self._recorder = Recorder(self._address(), extra=self._extra if extra is None else extra, small=own,
                                  snapshots=self._snapshots, settings=self._settings,
                                  predictive=self._predictive, **objects)
        return self._recorder

    def _restore(self) -> RestoreResult:
        """Load the newest sealed version into the recorded objects."""
        assert self._recorder is not None, "_open builds the recorder"
        self.restored = self._recorder.restore()
        return self.restored

    def _commit(self, step: int, metrics: Mapping[str, float] | None = None) -> Future[CommitResult]:
        assert self._recorder is not None, "_open builds the recorder"
        return self._recorder.commit(step, metrics)

    def close(self) -> None:
        """Write every queued version and release the recorder."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
