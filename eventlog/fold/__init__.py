"""The exactly-once fold engine: reading a run's log into shard state, to a target.

It sits in the log layer, not in ``replayer``, because both the snapshotter (compaction)
and the replayer fold the log with the same rule, and the snapshotter is the lower layer:
``engine`` indexes the control partition and folds shards, ``apply`` holds the one
exactly-once apply rule, ``deferred`` batches predictive optimizer steps tile by tile, and
``sharing`` is the work board that replay workers share.
"""

from eventlog.fold.engine import ControlIndex, FoldStart, RebuiltState, index_control, rebuild
from eventlog.target import Target

__all__ = ["ControlIndex", "FoldStart", "RebuiltState", "Target", "index_control", "rebuild"]
