"""The version a run records is the installed distribution's, read from its package metadata."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Records one version with the distribution metadata in ``sys.argv[1]`` found first, and
#: prints the version its ``RunStarted`` event holds.
_RECORD = '''
import sys
sys.path.insert(0, sys.argv[1])
import torch
from eventlog import RunAddress
from eventlog.fold.engine import index_control
from rewind.recorder import Recorder
url = f"sqlite://{sys.argv[2]}/rewind.db"
model = torch.nn.Linear(4, 3)
with Recorder(RunAddress(url, url, "r"), model, torch.optim.SGD(model.parameters(), lr=0.1)) as rec:
    rec.commit(0, wait=True)
with RunAddress(url, url, "r").open_log() as log:
    ((_, started),) = index_control(log).run_started
print(started.body.rewind_version)
'''


def test_a_run_records_the_installed_distributions_version(tmp_path: Path) -> None:
    dist = tmp_path / "site" / "rewind-9.9.9.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rewind\nVersion: 9.9.9\n")
    proc = subprocess.run([sys.executable, "-c", _RECORD, str(tmp_path / "site"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "9.9.9"


def test_a_source_tree_never_installed_claims_no_release(tmp_path: Path) -> None:
    # -I -S: no PYTHONPATH and no site-packages, so no installed rewind distribution; a copy of
    # the package alone is importable (a checkout installed editable holds rewind.egg-info).
    shutil.copytree(ROOT / "eventlog", tmp_path / "eventlog", ignore=shutil.ignore_patterns("__pycache__"))
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "from eventlog.version import REWIND_VERSION; print(REWIND_VERSION)")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "0+unknown"
