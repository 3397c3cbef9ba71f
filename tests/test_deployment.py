"""Where runs live and which keys protect them: read from the environment at each use, through
``eventlog.settings.Deployment``."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventlog import RunAddress, crypto
from eventlog.kafka.config import KafkaSettings
from eventlog.settings import Deployment

_VARIABLES = ("REWIND_LOG", "REWIND_COORD", "REWIND_SNAPSHOTS", "REWIND_KEY_FILE", "REWIND_KEYS",
              "REWIND_ACTIVE_KEY")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_run_address_follows_the_environment_as_it_is_now(clean_env: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    clean_env.chdir(tmp_path)
    assert RunAddress.from_env("r") == RunAddress(f"sqlite://{tmp_path}/rewind.db",
                                                  f"sqlite://{tmp_path}/rewind.db", "r")
    clean_env.setenv("REWIND_LOG", "kafka://h:9092")
    clean_env.setenv("REWIND_SNAPSHOTS", f"file://{tmp_path}/snaps")
    assert RunAddress.from_env("r") == RunAddress("kafka://h:9092", "kafka://h:9092", "r",
                                                  f"file://{tmp_path}/snaps")
    clean_env.setenv("REWIND_COORD", "redis://h:6379/0")
    clean_env.setenv("REWIND_SNAPSHOTS", "")  # empty: no store
    assert RunAddress.from_env("r") == RunAddress("kafka://h:9092", "redis://h:6379/0", "r")


def test_kafka_options_from_the_environment_yield_to_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWIND_KAFKA_CONF_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("REWIND_KAFKA_CONF_CLIENT_ID", "from-env")
    monkeypatch.setenv("REWIND_KAFKA_CONF_", "no key")
    settings = KafkaSettings("kafka://h:9092?client.id=from-url")
    assert settings.common == {"sasl.mechanism": "PLAIN", "client.id": "from-url"}


def test_keys_rotated_in_the_environment_take_effect_in_a_running_process(
        clean_env: pytest.MonkeyPatch) -> None:
    assert crypto.keyring() is None
    clean_env.setenv("REWIND_KEYS", f"a={bytes(range(32)).hex()}")
    first = crypto.keyring()
    assert first is not None and first.active == "a"
    clean_env.setenv("REWIND_KEYS", f"a={bytes(range(32)).hex()},b={bytes(range(1, 33)).hex()}")
    second = crypto.keyring()
    assert second is not None and (second.active, sorted(second.keys)) == ("b", ["a", "b"])


def test_a_mapping_stands_in_for_the_environment() -> None:
    found = Deployment.from_env({"REWIND_LOG": "", "REWIND_KAFKA_CONF_ACKS_TIMEOUT_MS": "5"})
    assert (found.log, found.coord, found.snapshots) == ("", None, "")
    assert dict(found.kafka_conf) == {"acks.timeout.ms": "5"}
