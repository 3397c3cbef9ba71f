"""Choosing backends by URL: ``sqlite://<path>`` (embedded, the default), ``kafka://``, ``redis://``.

A run is addressed by a ``RunAddress``: the log URL, the coordinator URL and the run id.
``--run-dir DIR`` is shorthand for the embedded database ``DIR/rewind.db``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eventlog.errors import ConfigError
from eventlog.ports import Coordinator, EventLog
from eventlog.settings import deployment

DB_NAME = "rewind.db"


@dataclass(frozen=True)
class RunAddress:
    """Where a run lives: its log, its coordinator, and its id."""

    log_url: str
    coord_url: str
    run_id: str
    #: Where the run's snapshots live (``file://DIR``); read by the snapshotter and replayer.
    snapshots_url: str | None = None
    #: Open the log and coordinator for reading only: an embedded database must exist
    #: already and nothing is created or written in it (the CLI's read commands).
    read_only: bool = False

    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike[str], run_id: str | None = None) -> RunAddress:
        """The embedded run stored in ``run_dir``; the run id may be left out if there is one."""
        if Path(run_dir).name == DB_NAME and Path(run_dir).is_file():
            raise ConfigError(f"{run_dir} is the run's database: pass the directory that holds it "
                              f"(--run-dir {Path(run_dir).parent})")
        db = Path(run_dir).resolve() / DB_NAME
        url = run_dir_url(run_dir)
        if not db.exists():
            raise ConfigError(f"no Rewind run in {run_dir}: {db} does not exist")
        if run_id is None:
            runs = list_runs(url)
            if not runs:
                raise ConfigError(f"no run in {run_dir} has recorded an event yet ({db})")
            if len(runs) != 1:
                raise ConfigError(f"{run_dir} holds {len(runs)} runs ({', '.join(runs)}): name one "
                                  f"(--run ID; to bisect, {run_dir}#ID)")
            run_id = runs[0]
        return cls(url, url, run_id, f"file://{Path(run_dir).resolve() / 'snapshots'}")

    @classmethod
    def from_env(cls, run_id: str) -> RunAddress:
        """Backends from ``REWIND_LOG`` / ``REWIND_COORD``, else ``./rewind.db``; the snapshot
        store from ``REWIND_SNAPSHOTS`` (``file://DIR``), if set."""
        env = deployment()
        log = f"sqlite://{Path(DB_NAME).resolve()}" if env.log is None else env.log
        return cls(log, log if env.coord is None else env.coord, run_id, env.snapshots or None)

    def open_log(self) -> EventLog:
        """Open this run's log."""
        return open_log(self.log_url, self.run_id, read_only=self.read_only)

    def open_coordinator(self) -> Coordinator:
        """Open the coordinator."""
        return open_coordinator(self.coord_url, read_only=self.read_only)


def run_dir_url(run_dir: str | os.PathLike[str]) -> str:
    """The log URL of the embedded run directory ``run_dir``: its database file."""
    return f"sqlite://{Path(run_dir).resolve() / DB_NAME}"


def _scheme(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ConfigError(f"backend URL {url!r} has no scheme (sqlite://, kafka://, redis://)")
    return scheme


def check_log_url(url: str) -> str:
    """The scheme of a log URL; the error ``open_log`` would raise for one no backend takes."""
    scheme = _scheme(url)
    if scheme not in ("sqlite", "kafka"):
        raise ConfigError(f"unknown log backend {scheme!r} in {url!r}; use sqlite:// or kafka://")
    return scheme


def open_log(url: str, run_id: str, *, read_only: bool = False) -> EventLog:
    """Open run ``run_id``'s log on the backend ``url`` names; ``read_only``: an embedded
    database must exist and is not written (Kafka topics are only created by writers)."""
    if check_log_url(url) == "sqlite":
        from eventlog.embedded import EmbeddedLog

        return EmbeddedLog(url, run_id, read_only=read_only)
    from eventlog.kafka import KafkaLog

    return KafkaLog(url, run_id)


def open_coordinator(url: str, *, read_only: bool = False) -> Coordinator:
    """Open the coordinator ``url`` names; ``read_only`` as for ``open_log``."""
    scheme = _scheme(url)
    if scheme == "sqlite":
        from eventlog.embedded import EmbeddedCoordinator

        return EmbeddedCoordinator(url, read_only=read_only)
    if scheme in ("redis", "rediss"):
        from eventlog.redis.coordinator import RedisCoordinator

        return RedisCoordinator(url)
    raise ConfigError(f"unknown coordinator {scheme!r} in {url!r}; use sqlite:// or redis://")


def list_runs(url: str) -> list[str]:
    """Runs recorded in the log at ``url``."""
    scheme = _scheme(url)
    if scheme == "sqlite":
        from eventlog.embedded import list_runs as embedded_runs

        return embedded_runs(url)
    if scheme == "kafka":
        from eventlog.kafka import list_runs as kafka_runs

        return kafka_runs(url)
    raise ConfigError(f"unknown log backend {scheme!r} in {url!r}")


def store_damage(url: str) -> list[str]:
    """Damage in the storage of the log at ``url`` that reading its records does not meet
    (``eventlog.embedded.check``: its tables, indexes and fencing epochs), each a line naming
    the file. Empty for Kafka: the broker keeps that state, and its fencing epochs."""
    if check_log_url(url) != "sqlite":
        return []
    from eventlog.embedded import path_from_url
    from eventlog.embedded.check import store_damage as embedded_damage

    return embedded_damage(path_from_url(url))
