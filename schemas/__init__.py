"""The event contract: Avro schemas (``v<N>/*.avsc``), parsed once, with their fingerprints.

Each schema version lives in its own folder. A version's Envelope schema is the writer
schema of every message encoded while it was current; readers keep every old version so
that a log written by an older Rewind still decodes (Avro schema resolution).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro.schema

#: The schema version new events are written with.
SCHEMA_VERSION = 4

#: Files in dependency order: a type is defined before any type that names it.
_FILES = (
    "TensorSpec",
    "RunStarted",
    "TensorDelta",
    "CommitSealed",
    "SchedulerStep",
    "RngAdvance",
    "SamplerCursor",
    "Metrics",
    "SnapshotBegin",
    "SnapshotEnd",
    "CustomState",
    "OptimizerStep",  # v3
    "EnvironmentFingerprint",  # v4
    "Resumed",  # v4
    "Envelope",
)

SCHEMA_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class EventSchema:
    """One version of the envelope schema, ready to encode and decode with."""

    version: int
    parsed: Any  # fastavro's parsed schema
    canonical: str  # Avro Parsing Canonical Form
    fingerprint: bytes  # CRC-64-AVRO of the canonical form, little-endian, 8 bytes


def schema_files(version: int = SCHEMA_VERSION) -> list[Path]:
    """The ``.avsc`` files of one schema version, definitions before their uses."""
    folder = SCHEMA_DIR / f"v{version}"
    # A type added in a later version has no file in the older folders.
    return [folder / f"{name}.avsc" for name in _FILES if (folder / f"{name}.avsc").exists()]


def available_versions() -> list[int]:
    """Every schema version shipped with this package, oldest first."""
    return sorted(int(p.name[1:]) for p in SCHEMA_DIR.glob("v[0-9]*") if p.is_dir())


def _inline(node: Any, defs: dict[str, Any], seen: set[str]) -> Any:
    """Replace references to named types by their definitions (first use only)."""
    if isinstance(node, str):
        if node in defs and node not in seen:
            seen.add(node)
            return _inline(defs[node], defs, seen)
        return node
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    if isinstance(node, dict):
        out = dict(node)
        if "fields" in out:
            out["fields"] = [{**f, "type": _inline(f["type"], defs, seen)} for f in out["fields"]]
        if "items" in out:
            out["items"] = _inline(out["items"], defs, seen)
        if "values" in out:
            out["values"] = _inline(out["values"], defs, seen)
        return out
    return node


@functools.cache
def envelope_json(version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The self-contained Envelope schema of ``version`` as JSON (named types inlined)."""
    defs: dict[str, Any] = {}
    for path in schema_files(version):
        doc = json.loads(path.read_text())
        defs[f"{doc['namespace']}.{doc['name']}"] = doc
    envelope = defs["rewind.Envelope"]
    result: dict[str, Any] = _inline(envelope, defs, {"rewind.Envelope"})
    return result


@functools.cache
def load(version: int = SCHEMA_VERSION) -> EventSchema:
    """Parse one schema version and compute its single-object-encoding fingerprint."""
    parsed = fastavro.schema.parse_schema(envelope_json(version))
    canonical = fastavro.schema.to_parsing_canonical_form(parsed)
    # fastavro's hex already lists the CRC-64-AVRO bytes little-endian, the order
    # single-object encoding stores them in (spec vector: "null" -> 8a8f25cce724dd63).
    fp = bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))
    return EventSchema(version=version, parsed=parsed, canonical=canonical, fingerprint=fp)


def by_fingerprint() -> dict[bytes, EventSchema]:
    """Every known schema version, keyed by fingerprint (for decoding old data)."""
    return {s.fingerprint: s for s in (load(v) for v in available_versions())}
