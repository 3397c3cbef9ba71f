"""Optional encryption at rest: AES-256-GCM on tensor payloads, small states and snapshot files.

Keys never come from the command line. ``REWIND_KEY_FILE`` names a file of ``key-id = key``
lines (base64 or hex, 32 bytes), or ``REWIND_KEYS`` holds ``id=key,id=key``; the active key
(used for new data) is ``REWIND_ACTIVE_KEY`` or else the last one listed. Older keys stay
configured so old data stays readable after a rotation. Each ciphertext is
``nonce (12 bytes) || AES-GCM(ciphertext + tag)``, with associated data binding it to its
run, gsn, shard, tensor and chunk: a chunk moved to another place fails authentication.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from eventlog.errors import ConfigError, CorruptMessageError
from eventlog.events import SMALL_STATE_TYPES, Envelope, OptimizerStep, TensorDelta
from eventlog.settings import Deployment, deployment

NONCE = 12
TAG = 16


class AuthenticationError(CorruptMessageError):
    """Encrypted data failed authentication: a wrong key, or bytes that were tampered with."""


def _parse_key(key_id: str, text: str) -> bytes:
    text = text.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True)):
        try:
            raw = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return raw
    raise ConfigError(f"encryption key {key_id!r} is not 32 bytes of hex or base64")


@dataclass(frozen=True)
class Keyring:
    """Configured keys by id, and the id new data is encrypted with."""

    keys: Mapping[str, bytes]
    active: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Keyring | None:
        """The keyring the environment (``os.environ``, or ``env``) configures, or ``None``
        (encryption off)."""
        found = Deployment.from_env(env)
        return cls.configured(found.key_file, found.keys, found.active_key)

    @classmethod
    def configured(cls, key_file: str, keys: str, active_key: str) -> Keyring | None:
        """The keyring of ``REWIND_KEY_FILE``, ``REWIND_KEYS`` and ``REWIND_ACTIVE_KEY``'s
        values (empty: unset), or ``None`` (encryption off)."""
        pairs: list[tuple[str, str]] = []
        if key_file:
            path = Path(key_file)
            try:
                lines = path.read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"REWIND_KEY_FILE {path}: {exc.strerror}") from exc
            for n, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                kid, sep, key = line.partition("=")
                if not sep:
                    raise ConfigError(f"{path}:{n}: want 'key-id = key'")
                pairs.append((kid.strip(), key))
        if keys:
            for item in keys.split(","):
                kid, sep, key = item.partition("=")
                if not sep:
                    raise ConfigError("REWIND_KEYS must look like id=key,id=key")
                pairs.append((kid.strip(), key))
        if not pairs:
            return None
        parsed = {kid: _parse_key(kid, key) for kid, key in pairs}
        active = active_key or pairs[-1][0]
        if active not in parsed:
            raise ConfigError(f"REWIND_ACTIVE_KEY {active!r} is not among the configured keys")
        return cls(parsed, active)

    def encrypt(self, plain: bytes, aad: bytes) -> bytes:
        """Encrypt with the active key; returns nonce || ciphertext || tag."""
        nonce = os.urandom(NONCE)
        return nonce + AESGCM(self.keys[self.active]).encrypt(nonce, plain, aad)

    def decrypt(self, key_id: str, data: bytes, aad: bytes, where: str) -> bytes:
        """Decrypt and authenticate, or raise ``AuthenticationError`` naming ``where``."""
        key = self.keys.get(key_id)
        if key is None:
            raise AuthenticationError(
                f"{where}: encrypted with key {key_id!r}, which is not configured "
                f"(configured: {', '.join(sorted(self.keys))})"
            )
        if len(data) < NONCE + TAG:
            raise AuthenticationError(f"{where}: ciphertext of {len(data)} bytes is too short")
        try:
            return AESGCM(key).decrypt(data[:NONCE], data[NONCE:], aad)
        except InvalidTag:
            raise AuthenticationError(
                f"{where}: authentication failed with key {key_id!r}: wrong key, or the "
                "data was tampered with or moved"
            ) from None


_override: list[Keyring | None] = []


@functools.lru_cache(maxsize=8)
def _configured(key_file: str, mtime: float, keys: str, active_key: str) -> Keyring | None:
    return Keyring.configured(key_file, keys, active_key)


def keyring() -> Keyring | None:
    """The keyring in force: an override (``using``), else the environment's (cached)."""
    if _override:
        return _override[-1]
    env = deployment()
    try:
        mtime = os.stat(env.key_file).st_mtime if env.key_file else 0.0
    except OSError:
        mtime = -1.0  # reported by Keyring.configured
    return _configured(env.key_file, mtime, env.keys, env.active_key)


@contextmanager
def using(kr: Keyring | None) -> Iterator[None]:
    """Use ``kr`` (or no encryption) in this process until the block ends."""
    _override.append(kr)
    try:
        yield
    finally:
        _override.pop()


def require(key_id: str, where: str) -> Keyring:
    """The keyring, which must be configured to read data encrypted with ``key_id``."""
    kr = keyring()
    if kr is None:
        raise AuthenticationError(
            f"{where}: encrypted with key {key_id!r}, but no key is configured "
            "(set REWIND_KEY_FILE or REWIND_KEYS)"
        )
    return kr


def event_aad(run_id: str, gsn: int, shard: int, name: str, chunk: int) -> bytes:
    """Associated data of one event's payload: where it belongs in which run."""
    return f"rewind-v1|{run_id}|{gsn}|{shard}|{name}|{chunk}".encode()


def _secret(env: Envelope) -> tuple[str, bytes, str, int] | None:
    """The field of an event that is encrypted: (field, bytes, name, chunk)."""
    body = env.body
    if isinstance(body, TensorDelta):
        return "payload", body.payload, body.name, body.chunk_index
    if isinstance(body, SMALL_STATE_TYPES):
        return "state", body.state, body.name, 0
    if isinstance(body, OptimizerStep):
        return "hyperparams", body.hyperparams, "optimizer-step", body.index
    return None


def encrypt_event(env: Envelope, kr: Keyring) -> Envelope:
    """The event with its payload or state encrypted under the active key."""
    secret = _secret(env)
    if secret is None:
        return env
    field, plain, name, chunk = secret
    aad = event_aad(env.run_id, env.gsn, env.shard, name, chunk)
    body = _with_field(env.body, field, kr.encrypt(plain, aad))
    return dataclasses.replace(env, body=body, key_id=kr.active)


def decrypt_event(env: Envelope, where: str) -> Envelope:
    """The event with its payload or state decrypted; plaintext events pass unchanged."""
    if env.key_id is None:
        return env
    secret = _secret(env)
    if secret is None:
        return env
    field, data, name, chunk = secret
    aad = event_aad(env.run_id, env.gsn, env.shard, name, chunk)
    plain = require(env.key_id, where).decrypt(env.key_id, data, aad, where)
    return dataclasses.replace(env, body=_with_field(env.body, field, plain))


def _with_field(body: Any, field: str, value: bytes) -> Any:
    """``body`` with its secret ``field`` replaced (the field is chosen at run time)."""
    return dataclasses.replace(body, **{field: value})
