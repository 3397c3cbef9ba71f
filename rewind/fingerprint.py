"""What a recorder logs about its environment and its resumes (schema v4).

``environment()`` reads the settings that decide which bits a training step computes:
library versions, determinism flags, threads, host, world size. A recorder logs one at the
run's first version and one at each ``restore()``, with a ``Resumed`` event naming the
version it loaded and the state digest it checked against that version's seal.
"""

from __future__ import annotations

import platform
import socket

import torch

from eventlog.commit.pipeline import CommitPipeline
from eventlog.events import EnvironmentFingerprint, Resumed
from eventlog.fold.engine import RebuiltState
from eventlog.settings import host_variable
from replayer.replay import ReplayReport


def world_size() -> int:
    """The ``torch.distributed`` world size (1 without a process group)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def environment(reason: str) -> EnvironmentFingerprint:
    """This process's environment, as a fingerprint event (``reason``: start or resume)."""
    cudnn = torch.backends.cudnn
    # Without a GPU cuDNN is never used: loading its libraries for their version alone
    # would map tens of MB of code into the process.
    cudnn_version = (cudnn.version() if torch.cuda.is_available() and cudnn.is_available()  # type: ignore[no-untyped-call]
                     else None)
    return EnvironmentFingerprint(
        reason=reason,
        torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda,
        cudnn_version=None if cudnn_version is None else str(cudnn_version),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        cublas_workspace_config=host_variable("CUBLAS_WORKSPACE_CONFIG"),
        cudnn_benchmark=bool(cudnn.benchmark),
        cudnn_deterministic=bool(cudnn.deterministic),
        matmul_precision=torch.get_float32_matmul_precision(),
        num_threads=torch.get_num_threads(),
        hostname=socket.gethostname(),
        world_size=world_size(),
        python_version=platform.python_version(),
    )


def log_resume(pipe: CommitPipeline, state: RebuiltState, report: ReplayReport) -> int:
    """Log, as ``pipe``'s writer, this process's environment and the proof of the resume
    ``state`` is (the version loaded, the state digest the replay checked against its seal,
    where it started); returns the last gsn used."""
    proof = Resumed(state.version, state.step, state.state_digest(), report.snapshot_id,
                    report.snapshot_version, report.tail_versions, state.counts.applied)
    return pipe.append_control(state.version, state.step, [environment(EnvironmentFingerprint.RESUME), proof])
