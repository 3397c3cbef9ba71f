"""One digest of a whole training state, built from the library's capture and digests.

The objects are taken apart the way the recorder takes them apart (``eventlog.capture``:
tensor roles flattened into log tensors, every other state packed by the small-state
codec) and hashed with ``eventlog.digests``, all tensors as one shard. Two states have
the same digest only if every recorded bit is the same.
"""

from __future__ import annotations

from collections.abc import Mapping

from eventlog import statecodec, tensorcodec
from eventlog.capture import TENSOR_ROLES, Stateful, flatten
from eventlog.digests import chunk_digests, shard_digest, small_digest, state_digest, tensor_digest

# Chunk boundaries enter the tensor digests; fixed here so that the digest of a state never
# depends on a setting of the process that computes it.
_CHUNK_BYTES = 4 << 20


def digest_of(objects: Mapping[str, Stateful]) -> str:
    """Hex digest of the states of ``objects`` (``{name: Stateful}``); consumes no randomness."""
    tensors: dict[str, bytes] = {}
    small: dict[str, bytes] = {}
    for name, obj in objects.items():
        tree = obj.state_dict()
        if name in TENSOR_ROLES:
            found, tree = flatten(name, tree)
            for key, t in found.items():
                bits = tensorcodec.tensor_bits(t)
                tensors[key] = tensor_digest(key, tensorcodec.dtype_name(t.dtype), tuple(t.shape),
                                             chunk_digests(bits, _CHUNK_BYTES))
        small[name] = statecodec.pack(tree)
    return state_digest([shard_digest(tensors)], small_digest(small)).hex()
