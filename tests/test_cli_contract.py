"""The installed ``rewind`` script's contract, as scripts and CI see it.

Every command is run as a subprocess of the console script (not through a test runner,
which would hide what ``main()`` does to exit codes): exit 0 on success, 1 when its check
fails, 2 on a usage or Rewind error with one line on stderr and no traceback, and
``--json`` output that parses with the documented top-level keys. One small recorded run
(with a snapshot) is built once and shared; the command lines run in parallel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from eventlog import ConfigError, EventLogError, RunAddress, Target
from rewind import Recorder
from rewind.cli import app
from snapshotter.policies import keep_all
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_cli_contract")

REWIND = shutil.which("rewind")
RUN = "contract"
LONG_METRIC = "episode_return_mean_over_the_last_100_episodes"
VERSIONS = 4  # steps 0..3; the snapshot is of version 2 (step 1)
#: Every help screen: the app's and each command's.
HELPS = ["", *(c.name or "" for c in app.registered_commands)]

Result = subprocess.CompletedProcess[str]


def _record(run_dir: Path) -> None:
    """A tiny model recorded for VERSIONS steps, with one snapshot in the middle."""
    db = run_dir / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", RUN, f"file://{run_dir / 'snapshots'}")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(address, model, opt, chunk_bytes=64, shards=1) as rec:
        for step in range(VERSIONS):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            rec.commit(step, metrics={"loss": 1.0 / (step + 1), LONG_METRIC: 10.0 * step}, wait=True)
            if step == 1:
                config = SnapshotterConfig(retention=keep_all())
                with Snapshotter(address, SnapshotStore(address.snapshots_url or ""), config) as snap:
                    assert snap.snapshot(force=True) is not None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _damage_a_snapshot(run_dir: Path) -> Path:
    """Flip one byte of the snapshot's shard file; returns the file."""
    (shard,) = run_dir.glob("snapshots/*/*/shard-0.*")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def _files(root: Path) -> set[str]:
    """Files under ``root``, without SQLite's side files (a reader may create those)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Result]]]:
    """Every command line below, run once (in parallel) against one recorded run."""
    assert REWIND, "the rewind console script is not installed (pip install -e .)"
    tmp = tmp_path_factory.mktemp("cli")
    run = tmp / "run"
    _record(run)
    copies = {}
    for name in ("snap", "snapper", "damaged"):
        copies[name] = tmp / name
        shutil.copytree(run, copies[name])
    _damage_a_snapshot(copies["damaged"])
    (tmp / "a-file").write_text("not a directory")
    for name, files in (("full", ["notes.txt"]), ("stale", ["model.pt", "old/recovery.json"])):
        for f in files:
            (tmp / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name / f).write_text("the user's own file")
    before = _files(run)
    rd = ["--run-dir", str(run)]
    cases: dict[str, list[str]] = {
        # success, with --json (the failed-check and table cases follow)
        "ok/replay": ["replay", *rd, "--to", "step=2", "--json"],
        "ok/recover": ["recover", *rd, "--out", str(tmp / "ckpt"), "--json"],
        "ok/export": ["export", *rd, "--format", "hf", "--out", str(tmp / "hf"), "--json"],
        "ok/history": ["history", *rd, "--json"],
        "ok/diff": ["diff", *rd, "--from", "step=1", "--to", "step=1", "--exit-code", "--json"],
        "ok/plot": ["plot", *rd, "--out", str(tmp / "timeline.png"), "--json"],
        "ok/followers": ["followers", *rd, "--json"],
        "ok/snapshot": ["snapshot", "--run-dir", str(copies["snap"]), "--json"],
        "ok/snapshotter": ["snapshotter", "--run-dir", str(copies["snapper"]), "--every-versions", "1",
                           "--max-snapshots", "1", "--json"],
        "ok/verify": ["verify", *rd, "--json"],
        "ok/help": [],
        "fail/verify": ["verify", "--run-dir", str(copies["damaged"]), "--json"],
        "fail/diff": ["diff", *rd, "--from", "step=0", "--exit-code", "--json"],
        "table/history": ["history", *rd],
        "table/verify": ["verify", *rd],
        "table/verify-damaged": ["verify", "--run-dir", str(copies["damaged"])],
        "table/verify-by-log": ["verify", "--log", f"sqlite://{run / 'rewind.db'}", "--run", RUN],
        "ok/export-overwrite": ["export", *rd, "--format", "safetensors", "--out", str(tmp / "stale"),
                                "--overwrite", "--json"],
        "version": ["--version"],
        **{f"help/{name}": [*name.split(), "--help"] for name in HELPS},
        # usage errors: one per command
        "usage/replay": ["replay", "--bogus"],
        "usage/recover": ["recover", *rd],
        "usage/export": ["export", *rd],
        "usage/history": ["history", "--json", "stray-argument"],
        "usage/diff": ["diff", *rd],
        "usage/plot": ["plot", *rd],
        "usage/followers": ["followers", *rd, "--forget-silent-for", "soon"],
        "usage/snapshot": ["snapshot", *rd, "--keep-last", "-1"],
        "usage/snapshotter": ["snapshotter", *rd, "--every-versions", "0"],
        "usage/verify": ["verify", *rd, "--workers", "0"],
        "usage/demo": ["demo", "--bogus"],
        "usage/no-such-command": ["nosuch"],
        "usage/to-not-a-target": ["replay", *rd, "--to", "step=abc"],
        "usage/from-not-a-target": ["diff", *rd, "--from", "step=1.5"],
        # Rewind errors
        "error/new-db": ["history", "--log", f"sqlite://{tmp / 'new' / 'rewind.db'}", "--run", RUN],
        "error/no-snapshot-store": ["replay", *rd, "--snapshots", f"file://{tmp / 'nowhere'}"],
        "error/export-format": ["export", *rd, "--out", str(tmp / "onnx"), "--format", "onnx"],
        "error/offset-past-end": ["replay", *rd, "--to", "offset=999999"],
        "error/gsn-past-end": ["replay", *rd, "--to", "gsn=99999999"],
        "error/plot-format": ["plot", *rd, "--out", str(tmp / "timeline.txt")],
        "error/export-to-a-file": ["export", *rd, "--out", str(tmp / "a-file")],
        "error/recover-into-non-empty": ["recover", *rd, "--out", str(tmp / "full")],
        # refused before the run is even opened
        "error/export-into-non-empty": ["export", "--run-dir", str(tmp / "no-run"),
                                        "--out", str(tmp / "full")],
        "ok/plot-suffix": ["plot", *rd, "--out", str(tmp / "timeline"), "--json"],
        "error/keep-best": ["snapshotter", *rd, "--keep-best", "reward:x", "--json"],
        "error/kafka": ["history", "--log", f"kafka://127.0.0.1:{_closed_port()}", "--run", RUN],
    }
    # Output piped, no COLUMNS: tables fit 80 columns, what a pipe is given.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}

    def invoke(args: list[str]) -> Result:
        return subprocess.run([str(REWIND), *args], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp)

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(cases, pool.map(invoke, cases.values()), strict=True))
    assert _files(run) == before, "a read-only command wrote into the run directory"
    yield tmp, results


def _doc(result: Result, command: str) -> dict:  # type: ignore[type-arg]
    doc = json.loads(result.stdout)
    assert doc["command"] == command and isinstance(doc["ok"], bool), doc
    return doc  # type: ignore[no-any-return]


def _one_error_line(result: Result) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


KEYS = {
    "replay": {"report"}, "recover": {"report", "files"}, "export": {"report", "format", "files"},
    "history": {"run", "rows"}, "diff": {"from", "to", "differs", "tensors"}, "plot": {"run", "file"},
    "followers": {"run", "followers", "forgotten"}, "snapshot": {"run", "snapshot"},
    "snapshotter": {"run", "written"}, "verify": {"run", "findings"},
}


@pytest.mark.parametrize("command", sorted(KEYS))
def test_success_exits_0_with_the_documented_json(cli: tuple[Path, dict[str, Result]], command: str) -> None:
    result = cli[1][f"ok/{command}"]
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    doc = _doc(result, command)
    assert doc["ok"] is True and KEYS[command] <= doc.keys(), doc.keys()


def test_success_json_holds_what_each_command_did(cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    replay = _doc(results["ok/replay"], "replay")["report"]
    assert (replay["version"], replay["step"]) == (3, 2)
    history = _doc(results["ok/history"], "history")["rows"]
    assert [r["version"] for r in history if r["kind"] == "version"] == list(range(1, VERSIONS + 1))
    assert all(LONG_METRIC in r["metrics"] for r in history if r["kind"] == "version")
    assert _doc(results["ok/diff"], "diff")["differs"] is False
    assert _doc(results["ok/snapshot"], "snapshot")["snapshot"]["version"] == VERSIONS
    assert _doc(results["ok/snapshotter"], "snapshotter")["written"] == 1
    assert _doc(results["ok/followers"], "followers")["followers"] == []
    exported = _doc(results["ok/export"], "export")["files"]
    assert exported and all(stat.S_IMODE(Path(f).stat().st_mode) == 0o644 for f in exported), \
        [oct(Path(f).stat().st_mode) for f in exported]  # the test process's umask is 022
    assert Path(_doc(results["ok/plot"], "plot")["file"]).stat().st_size > 0
    # A name without a suffix gets .png, and the report names the file written.
    written = Path(_doc(results["ok/plot-suffix"], "plot")["file"])
    assert written.name == "timeline.png" and written.read_bytes().startswith(b"\x89PNG")
    assert results["ok/help"].returncode == 0 and "Exit status" in results["ok/help"].stdout


@pytest.mark.parametrize("command", ["verify", "diff"])
def test_a_failed_check_exits_1_and_says_so_in_json(cli: tuple[Path, dict[str, Result]],
                                                     command: str) -> None:
    result = cli[1][f"fail/{command}"]
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    doc = _doc(result, command)
    assert doc["ok"] is False
    if command == "verify":
        failed = [f for f in doc["findings"] if f["status"] == "FAIL"]
        assert failed and any("snapshot" in f["subject"] for f in failed), doc["findings"]
    else:
        assert doc["differs"] is True and not all(t["bit_equal"] for t in doc["tensors"])


@pytest.mark.parametrize("command", [*sorted(KEYS), "demo", "no-such-command"])
def test_a_usage_error_exits_2_in_one_line(cli: tuple[Path, dict[str, Result]], command: str) -> None:
    line = _one_error_line(cli[1][f"usage/{command}"])
    assert line.startswith("error: usage: ") and "--help" in line, line


@pytest.mark.parametrize("args", [
    [], ["--help"], ["replay", "--help"], ["history", "--help"], ["bisect", "--help"],
    ["snapshotter", "--help"], ["demo", "--help"],
    ["replay", "--bogus"], ["verify", "--workers", "0"], ["nosuch"],
])
def test_help_and_usage_errors_import_no_torch(args: list[str]) -> None:
    """``rewind --help`` or a mistyped command line answers at once: the script imports torch
    only when a command runs."""
    assert REWIND, "the rewind console script is not installed (pip install -e .)"
    out = subprocess.run([str(REWIND), *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    timed = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rpartition("|")[2].strip() for line in timed}
    assert "rewind.cli" in imported  # the import log is there to read
    assert sorted(m for m in imported if m.split(".")[0] == "torch") == []
    said = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    if "--help" in args or not args:
        assert out.returncode == 0 and "Usage: rewind" in out.stdout and said == [], out.stderr
    else:
        assert out.returncode == 2 and len(said) == 1 and said[0].startswith("error: usage: "), out.stderr


def test_the_packages_load_each_name_on_first_use() -> None:
    """``import rewind`` imports no torch; every public name still resolves, and is listed."""
    code = ("import sys, eventlog, rewind, rewind.cli\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from eventlog import Target\n"  # a replay target needs no torch
            "assert rewind.Target is Target and 'torch' not in sys.modules\n"
            "from eventlog import Stateful\n"
            "assert rewind.Stateful is Stateful and 'torch' in sys.modules\n"
            "from rewind import *\n"
            "missing = [f'{m.__name__}.{n}' for m in (eventlog, rewind) for n in m.__all__\n"
            "           if n not in dir(m) or getattr(m, n) is None]\n"
            "assert not missing, missing\n"
            "print(Recorder.__name__, every_versions.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Recorder", "every_versions"]


@pytest.mark.parametrize(("case", "says"), [
    ("new-db", "no Rewind log at"), ("no-snapshot-store", "no snapshot store at"),
    ("export-format", "unknown export format 'onnx'"), ("keep-best", "--keep-best 'reward:x'"),
    ("kafka", "is unreachable"),
    ("offset-past-end", "offset=999999 is past the end of the control partition (its end offset is "),
    ("gsn-past-end", "gsn=99999999 is past the newest gsn the control partition records ("),
    ("plot-format", "timeline.txt: the timeline is a PNG; name a .png file"),
    ("export-to-a-file", "a-file is a file: name the directory to write"),
])
def test_a_rewind_error_exits_2_in_one_line(cli: tuple[Path, dict[str, Result]], case: str,
                                            says: str) -> None:
    tmp, results = cli
    line = _one_error_line(results[f"error/{case}"])
    assert says in line, line
    if case == "new-db":  # a read-only command creates nothing
        assert not (tmp / "new").exists()
    if case == "export-format":  # refused before any replay or write
        assert not (tmp / "onnx").exists()


def test_the_history_table_fits_80_columns_and_names_each_encoding_once(
        cli: tuple[Path, dict[str, Result]]) -> None:
    result = cli[1]["table/history"]
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert sum(LONG_METRIC + "=" in line for line in lines) == VERSIONS  # whole, on every version
    notes = [line for line in lines if line.startswith("[")]
    assert notes and len(set(notes)) == len(notes)
    assert not any("blosc2" in line for line in lines if not line.startswith(("[", "    "))), \
        "an encoding's full text belongs in its note, not on every row"


def test_an_unreachable_kafka_broker_fails_fast_and_quietly(capfd: pytest.CaptureFixture[str]) -> None:
    from eventlog.kafka import CONNECT_TIMEOUT_S, KafkaLog

    t0 = time.monotonic()
    with pytest.raises(EventLogError, match="is unreachable"):
        KafkaLog(f"kafka://127.0.0.1:{_closed_port()}", RUN)
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 3
    assert "FAIL" not in capfd.readouterr().err  # librdkafka's own lines are not printed


def test_an_unreachable_redis_fails_fast() -> None:
    from eventlog.errors import CoordinationError
    from eventlog.redis.coordinator import CONNECT_TIMEOUT_S, RedisCoordinator

    t0 = time.monotonic()
    with pytest.raises(CoordinationError, match="is unreachable"):
        RedisCoordinator(f"redis://127.0.0.1:{_closed_port()}/0")
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 1


@pytest.mark.parametrize(("case", "option", "value"), [
    ("usage/to-not-a-target", "--to", "step=abc"), ("usage/from-not-a-target", "--from", "step=1.5"),
])
def test_a_target_that_names_none_is_a_usage_error(cli: tuple[Path, dict[str, Result]], case: str,
                                                    option: str, value: str) -> None:
    line = _one_error_line(cli[1][case])
    assert line.startswith(f"error: usage: Invalid value for '{option}': bad replay target '{value}': "
                           "use latest, version=V"), line
    with pytest.raises(ConfigError, match="bad replay target"):  # the API's word for a bad argument
        Target.parse(value)


def test_recover_and_export_refuse_a_non_empty_out_unless_told_to_overwrite(
        cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    for case in ("recover", "export"):
        line = _one_error_line(results[f"error/{case}-into-non-empty"])
        assert line == (f"error: ConfigError: --out {tmp / 'full'} is not empty: name a new or empty "
                        "directory, or pass --overwrite to replace what it holds"), line
    assert _files(tmp / "full") == {"notes.txt"}  # nothing written, nothing removed
    # --overwrite: the directory then holds what this export wrote, and only that.
    doc = _doc(results["ok/export-overwrite"], "export")
    assert doc["files"] == [str(tmp / "stale" / "model.safetensors")]
    assert _files(tmp / "stale") == {"model.safetensors"}
    assert [p.name for p in tmp.iterdir() if p.name.startswith(".stale")] == []


def test_version_and_every_help_shows_flags_as_flags(cli: tuple[Path, dict[str, Result]]) -> None:
    from importlib.metadata import version

    results = cli[1]
    assert results["version"].returncode == 0 and results["version"].stderr == ""
    assert results["version"].stdout == f"rewind {version('rewind')}\n"
    assert len(HELPS) > 10
    for name in HELPS:
        shown = results[f"help/{name}"]
        assert shown.returncode == 0, (name, shown.stderr)
        assert "<bool>" not in shown.stdout, (name, shown.stdout)
        assert re.search(r"--help +Show this message and exit", shown.stdout), (name, shown.stdout)
        if name:
            assert re.search(r"--json +print one JSON object", shown.stdout), (name, shown.stdout)
    assert re.search(r"--version +print the version and exit", results["help/"].stdout)


def test_verify_fits_80_columns_piped_naming_the_directory_of_its_paths_once(
        cli: tuple[Path, dict[str, Result]]) -> None:
    """The run directory given (else the one the paths share) is named once; the snapshot
    folders and files inside it are shown relative to it."""
    tmp, results = cli
    for case, status, base, shown in (
            ("table/verify", 0, tmp / "run", f"snapshots/{RUN}/v0000000002-"),
            ("table/verify-damaged", 1, tmp / "damaged", f"snapshots/{RUN}/v0000000002-"),
            ("table/verify-by-log", 0, tmp / "run" / "snapshots" / RUN, "v0000000002-")):
        result = results[case]
        assert result.returncode == status and result.stderr == "", result.stderr
        lines = result.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, "\n".join(lines)
        head, said, findings = " ".join(result.stdout.split()).partition(f"(paths below are in {base})")
        assert said and str(tmp) not in findings, result.stdout
        assert f" {shown}" in findings.replace("(", " "), result.stdout


def test_sb3_metrics_stay_in_the_history_metrics_column_piped(tmp_path: Path) -> None:
    """A version's metrics (SB3's ``train/...`` names, on 80 columns) are wrapped inside their
    column, beside their version, with each group's name once; a version without any shows -."""
    sb3 = {"train/approx_kl": 0.0003302, "train/clip_fraction": 0.0, "train/entropy_loss": -0.693,
           "train/explained_variance": -0.001315, "train/learning_rate": 0.0003, "train/loss": 59.04,
           "train/n_updates": 10.0, "train/policy_gradient_loss": -0.001735, "train/value_loss": 110.6,
           "rollout/ep_len_mean": 22.5, "rollout/ep_rew_mean": 22.5, "time/fps": 1234.0}
    db = tmp_path / "rewind.db"
    model = torch.nn.Linear(2, 1)
    with Recorder(RunAddress(f"sqlite://{db}", f"sqlite://{db}", "sb3"), model, rng=False) as rec:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            rec.commit(step * 64, metrics=sb3 if step else None, wait=True)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    result = subprocess.run([str(REWIND), "history", "--run-dir", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    rows = [line for line in lines if re.match(r" +\d+ +\d+ +\d\d:\d\d:\d\d ", line)]
    assert len(rows) == 3 and rows[0].endswith("  -"), result.stdout
    column = rows[0].rindex("-")
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in rows), result.stdout
    text = " ".join(result.stdout.split())
    assert text.count("train: approx_kl=0.0003302") == 2 and text.count("policy_gradient_loss=-0.001735") == 2
    assert text.count("rollout: ep_len_mean=22.5 ep_rew_mean=22.5 time: fps=1234") == 2, text
