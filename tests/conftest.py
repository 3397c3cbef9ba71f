"""Shared fixtures: the backend matrix (embedded, and a real Kafka broker + redis-server).

``scripts/test`` starts the services and exports ``REWIND_TEST_KAFKA`` (bootstrap) and
``REWIND_TEST_REDIS`` (URL). Without them the kafka half of the matrix is skipped with a
reason, unless ``REWIND_REQUIRE_SERVICES=1`` (set in CI), where their absence fails.
Tests marked ``kafka_cluster`` also need the 3-broker cluster (``REWIND_TEST_KAFKA_CLUSTER``,
``REWIND_KAFKA_CLUSTER_PIDFILES``; ``scripts/test`` starts it unless ``REWIND_TEST_CLUSTER=0``);
without it they are deselected with a warning, and in CI the run fails.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eventlog import RunAddress
from eventlog.settings import Settings, override

#: The tree under test. Child processes (the ``rewind`` command, torchrun ranks, probes)
#: import it too, not whichever checkout an editable install last pointed at.
ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

KAFKA = os.environ.get("REWIND_TEST_KAFKA")
REDIS = os.environ.get("REWIND_TEST_REDIS")
CLUSTER = os.environ.get("REWIND_TEST_KAFKA_CLUSTER")
REQUIRE = os.environ.get("REWIND_REQUIRE_SERVICES") == "1" or os.environ.get("CI") == "true"

BACKENDS = ["embedded", "kafka"]


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"rewind backends: embedded, kafka={KAFKA or 'not configured'}, redis={REDIS or '-'}, "
             f"kafka cluster={CLUSTER or 'not configured'}"]
    if KAFKA:
        try:
            from confluent_kafka.admin import AdminClient

            md = AdminClient({"bootstrap.servers": KAFKA}).list_topics(timeout=10)
            version = os.environ.get("REWIND_KAFKA_VERSION", "?")
            lines.append(f"kafka broker: Apache Kafka {version}, {len(md.brokers)} broker(s) at {KAFKA}")
        except Exception as exc:  # noqa: BLE001 - only a header
            lines.append(f"kafka broker at {KAFKA} did not answer: {exc}")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kafka_cluster: needs the 3-broker Kafka cluster and redis-server "
        "(scripts/services start --brokers 3)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without Kafka/Redis (or the cluster), deselect (and say so) the tests that need them;
    in CI, refuse to run."""
    if not (KAFKA and REDIS):
        _deselect(config, items, "REWIND_TEST_KAFKA / REWIND_TEST_REDIS", "kafka+redis", [
            i for i in items if i.get_closest_marker("kafka") or
            getattr(getattr(i, "callspec", None), "params", {}).get("backend") == "kafka"])
    if not (CLUSTER and REDIS):
        _deselect(config, items, "REWIND_TEST_KAFKA_CLUSTER / REWIND_TEST_REDIS", "kafka cluster",
                  [i for i in items if i.get_closest_marker("kafka_cluster")])


def _deselect(config: pytest.Config, items: list[pytest.Item], variables: str, what: str,
              needs: list[pytest.Item]) -> None:
    if not needs:
        return
    if REQUIRE:
        raise pytest.UsageError(f"{variables} are unset: run the suite via scripts/test")
    config.hook.pytest_deselected(items=needs)
    items[:] = [i for i in items if i not in needs]
    config.issue_config_time_warning(pytest.PytestWarning(
        f"{len(needs)} {what} tests deselected: no services configured (scripts/test starts them)"
    ), stacklevel=2)


def make_address(backend: str, tmp_path: Path, run_id: str | None = None) -> RunAddress:
    """A fresh run address on ``backend`` (each test gets its own run id / database)."""
    run_id = run_id or f"t{uuid.uuid4().hex[:10]}"
    if backend == "embedded":
        url = f"sqlite://{tmp_path / 'rewind.db'}"
        return RunAddress(url, url, run_id)
    assert KAFKA and REDIS, "kafka tests run only with services configured"
    return RunAddress(f"kafka://{KAFKA}?prefix=rewindtest", str(REDIS), run_id)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend of the contract matrix."""
    return str(request.param)


@pytest.fixture
def address(backend: str, tmp_path: Path) -> Iterator[RunAddress]:
    """A fresh run on the current backend."""
    yield make_address(backend, tmp_path)


@pytest.fixture
def configure() -> Iterator[Callable[..., Settings]]:
    """``configure(name=value, ...)`` changes the process's settings until the test ends
    (``eventlog.settings.override``, nested), and returns them."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))
