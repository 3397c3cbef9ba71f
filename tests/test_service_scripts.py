"""``scripts/kafka`` and ``scripts/redis`` tell a live server from a pid that only looks like one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Holds a second thread and prints its thread id; its command line names what it pretends to run.
_HOLDER = ("import sys, threading; e = threading.Event(); t = threading.Thread(target=e.wait); "
           "t.start(); print(t.native_id, flush=True); sys.stdin.read(); e.set()")


def test_a_pid_recycled_as_a_thread_or_another_nodes_broker_is_not_a_running_broker(tmp_path: Path) -> None:
    """A killed broker's pid file can name a pid that is now a thread of another broker (``/proc``
    answers for thread ids with their process's command line) or another node's broker: neither
    counts as that node running, or ``start`` waits for a node it never launched."""
    cluster = tmp_path / "kafka-cluster"
    node1 = cluster / "n1" / "server.properties"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, "kafka.Kafka", str(node1)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        tid = int(holder.stdout.readline())
        for node, pid in ((1, holder.pid), (2, tid), (3, holder.pid)):
            (cluster / f"n{node}").mkdir(parents=True, exist_ok=True)
            (cluster / f"n{node}" / "kafka.pid").write_text(f"{pid}\n")
        status = subprocess.run([str(ROOT / "scripts" / "kafka"), "status", "--brokers", "3"],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "REWIND_STATE_DIR": str(tmp_path)})
    finally:
        holder.communicate("", timeout=30)
    lines = status.stdout.splitlines()
    assert [line.split(" node ")[1].split(" (")[0] for line in lines] == \
        ["1 running", "2 not running", "3 not running"], status.stdout + status.stderr
    assert status.returncode == 3
