"""The embedded backend: one SQLite file holds the log and the coordinator (no servers).

SQLite gives the contract the Kafka backend gets from transactions: a transaction's records
become visible together at commit, a crash before commit leaves nothing (rollback journal
/ WAL), and a commit is durable on return (``synchronous=FULL``). Writers are fenced with
an epoch per writer id, checked inside the commit, like Kafka's ``transactional.id``.

URL: ``sqlite://<path>``, e.g. ``sqlite:///tmp/run/rewind.db`` (absolute) or
``sqlite://runs/rewind.db`` (relative).

Modules, one job each: ``db`` (the file: schema, format marker, connections, read-only
opens), ``writer`` (fenced transactions, segment-file appends, background checkpoints),
``reader`` (reads and lazy decoding), ``coordinator`` (``EmbeddedCoordinator``), ``log``
(``EmbeddedLog``, which composes them) and ``check`` (what ``rewind verify`` asks of the
file beyond its records). Large messages' segment files: ``eventlog.embedded.segments``.
"""

from eventlog.embedded.coordinator import EmbeddedCoordinator
from eventlog.embedded.db import FORMAT, path_from_url
from eventlog.embedded.log import EmbeddedLog, inline_segments, list_runs

__all__ = ["FORMAT", "EmbeddedCoordinator", "EmbeddedLog", "inline_segments", "list_runs", "path_from_url"]
