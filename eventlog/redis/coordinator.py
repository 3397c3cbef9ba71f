"""The Redis coordinator: version CAS, gsn blocks, catalog cache, leases and followers in Redis.

URL: ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` (TLS), with any option
``redis.Redis.from_url`` understands (``?ssl_ca_certs=...&socket_timeout=5``). Keys start
with ``rewind:``; a run's keys share the hash tag ``{<run>}`` and a lease's keys the tag
``{<name>}``, so each script touches one cluster slot.

Redis is a cache: if it loses its data, ``current_version`` reads 0 and gsn blocks restart
low. The Recorder rebuilds both from the log (``reset_version``, ``raise_gsn_floor``).
Every compound update is one Lua script, so it is atomic.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    NoPermissionError,
    ReadOnlyError,
    RedisError,
)
from redis.retry import Retry
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from eventlog.errors import ConfigError, CoordinationError, StaleVersionError
from eventlog.ports import Coordinator
from eventlog.waits import warned_wait

_log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

KEY_PREFIX = "rewind:"
#: Attempts at one operation before a transient fault becomes a ``CoordinationError``.
ATTEMPTS = 5
#: Opening a coordinator sends one PING, not retried, with this connect timeout (a URL's
#: ``socket_connect_timeout`` overrides it): a wrong address or a server that is down
#: fails then, in one line, not after every retry of the first real call.
CONNECT_TIMEOUT_S = 5.0
# ConnectionError and TimeoutError cover a restarting server and a dropped connection;
# BusyLoadingError a server still loading its dataset; ReadOnlyError a failover in progress.
_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
              BusyLoadingError, ReadOnlyError)

# Moves the version from ARGV[1] to ARGV[2]. ARGV[3] names this attempt: a retry after a
# lost reply finds its own write and succeeds instead of reporting itself as a rival.
_CAS = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if cur == tonumber(ARGV[2]) and redis.call('HGET', KEYS[1], 'op') == ARGV[3] then
  return {1, cur}
end
if cur ~= tonumber(ARGV[1]) then return {0, cur} end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'op', ARGV[3])
return {1, cur}
"""

_RAISE_FLOOR = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return cur
"""

# KEYS: lease hash {holder, expires (ms), token}, token counter (survives release and expiry).
# ARGV: holder, ttl ms, now ms ('' = the server's clock, which every client shares).
_ACQUIRE = """
local now
if ARGV[3] == '' then
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[3])
end
local ttl = tonumber(ARGV[2])
local holder = redis.call('HGET', KEYS[1], 'holder')
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if holder and expires > now then
  if holder ~= ARGV[1] then return false end
  redis.call('HSET', KEYS[1], 'expires', now + ttl)
  if ARGV[3] == '' then redis.call('PEXPIRE', KEYS[1], ttl) end
  return tonumber(redis.call('HGET', KEYS[1], 'token'))
end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'expires', now + ttl, 'token', token)
if ARGV[3] == '' then redis.call('PEXPIRE', KEYS[1], ttl) end
return token
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'holder')
  redis.call('HSET', KEYS[1], 'expires', 0)
  return 1
end
return 0
"""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def redact(url: str) -> str:
    """``url`` without its password (in the userinfo or a ``password=`` option)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if sep else f"{userinfo}@{host}"
    query = urlencode([(k, "***" if "password" in k.lower() else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*/:")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _coordinated(fn: Callable[P, R]) -> Callable[P, R]:
    """Retry transient Redis faults (bounded), then turn any Redis error into ours."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        self: RedisCoordinator = args[0]  # type: ignore[assignment]
        what = f"Redis coordinator {self.url}: {fn.__name__}"
        try:
            with warned_wait(f"Redis at {self.url} to answer {fn.__name__} (retrying; server down?)", _log):
                return self._retrying(fn, *args, **kwargs)
        except AuthenticationError as exc:
            problem = "the password was rejected" if self._has_password else (
                "the server requires a password and the URL gives none")
            raise CoordinationError(
                f"{what}: {problem} ({exc}); put it in the URL: redis://:PASSWORD@host:port/db"
            ) from exc
        except (AuthorizationError, NoPermissionError) as exc:
            raise CoordinationError(f"{what}: the Redis user lacks a permission ({exc})") from exc
        except _TRANSIENT as exc:
            raise CoordinationError(
                f"{what}: Redis unreachable or not ready after {ATTEMPTS} attempts "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        except RedisError as exc:
            raise CoordinationError(f"{what}: {type(exc).__name__}: {exc}") from exc

    return run


class RedisCoordinator(Coordinator):
    """Coordinator state in Redis (``redis://`` or ``rediss://``).

    ``clock`` (seconds) stamps follower reports; when given, it also times leases (tests
    use a fake one). By default leases use the Redis server's clock, shared by all clients.
    """

    def __init__(self, url: str, clock: Callable[[], float] | None = None) -> None:
        self.url = redact(url)
        parts = urlsplit(url)
        self._has_password = parts.password is not None or any(
            k.lower() == "password" for k, _ in parse_qsl(parts.query))
        self._clock = clock
        try:
            # Our tenacity policy is the only retry layer (the client's own is off), and
            # every socket call is bounded. Options in the URL override these defaults.
            self._r: redis.Redis = redis.Redis.from_url(
                url, socket_timeout=10.0, socket_connect_timeout=CONNECT_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0), decode_responses=False,
            )
        except (ValueError, TypeError, RedisError) as exc:
            raise ConfigError(f"bad Redis URL {self.url!r}: {exc}") from exc
        self._retrying = Retrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            # AuthenticationError is a ConnectionError to redis-py, but retrying cannot fix it.
            retry=retry_if_exception(
                lambda e: isinstance(e, _TRANSIENT) and not isinstance(e, AuthenticationError)),
            reraise=True,
        )
        self._first_contact()
        self._cas = self._r.register_script(_CAS)
        self._raise_floor = self._r.register_script(_RAISE_FLOOR)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._release = self._r.register_script(_RELEASE)

    def _first_contact(self) -> None:
        """One PING: an unreachable server is a ``CoordinationError`` now. A server that
        answers with an error (loading, a password problem) is reachable: the first real
        call retries or explains that."""
        try:
            self._r.ping()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            if isinstance(exc, AuthenticationError):
                return
            self._r.close()
            raise CoordinationError(
                f"Redis at {self.url} is unreachable ({type(exc).__name__}: {exc})") from exc
        except RedisError:
            return

    @staticmethod
    def _key(run: str, what: str) -> str:
        return f"{KEY_PREFIX}{{{run}}}:{what}"

    @_coordinated
    def current_version(self, run: str) -> int:
        """The run's version (0 if Redis has none, e.g. after it lost its data)."""
        raw = self._r.hget(self._key(run, "version"), "v")
        return 0 if raw is None else int(raw)

    def compare_and_set_version(self, run: str, expected: int, new: int) -> None:
        """Move the version from ``expected`` to ``new`` atomically (an absent key is 0)."""
        # One id per call, shared by its retries (see _CAS).
        self._compare_and_set(run, expected, new, uuid.uuid4().hex)

    @_coordinated
    def _compare_and_set(self, run: str, expected: int, new: int, op: str) -> None:
        ok, actual = self._cas(keys=[self._key(run, "version")], args=[expected, new, op])
        if not ok:
            raise StaleVersionError(expected, int(actual))

    @_coordinated
    def reset_version(self, run: str, version: int) -> None:
        """Overwrite the version with the one the log proves."""
        key = self._key(run, "version")
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(key, "v", version)
        pipe.hdel(key, "op")
        pipe.execute()

    @_coordinated
    def allocate_gsns(self, run: str, count: int) -> int:
        """Reserve ``count`` consecutive gsns with one INCRBY; returns the first."""
        if count < 0:
            raise CoordinationError(f"cannot allocate {count} gsns")
        # A retry after a lost reply allocates a second block: gsns only need to increase.
        last = int(self._r.incrby(self._key(run, "gsn"), count))
        return last - count + 1

    @_coordinated
    def raise_gsn_floor(self, run: str, floor: int) -> None:
        """Make every later allocation start above ``floor``."""
        self._raise_floor(keys=[self._key(run, "gsn")], args=[floor])

    @_coordinated
    def catalog_put(self, run: str, snapshot_id: str, entry: dict[str, Any]) -> None:
        """Cache one snapshot's catalog entry (JSON in a hash field)."""
        self._r.hset(self._key(run, "catalog"), snapshot_id, json.dumps(entry, sort_keys=True))

    @_coordinated
    def catalog(self, run: str) -> dict[str, dict[str, Any]]:
        """Every cached snapshot entry of the run."""
        out: dict[str, dict[str, Any]] = {}
        for sid, raw in self._r.hgetall(self._key(run, "catalog")).items():
            name = _text(sid)
            try:
                out[name] = json.loads(raw)
            except ValueError as exc:
                raise CoordinationError(
                    f"Redis coordinator {self.url}: catalog entry {name!r} of run {run!r} is not "
                    f"JSON ({exc}); delete it, the catalog is rebuilt from the log"
                ) from exc
        return out

    @_coordinated
    def catalog_delete(self, run: str, snapshot_id: str) -> None:
        """Forget one snapshot entry."""
        self._r.hdel(self._key(run, "catalog"), snapshot_id)

    @staticmethod
    def _lease_keys(name: str) -> list[str]:
        return [f"{KEY_PREFIX}lease:{{{name}}}", f"{KEY_PREFIX}lease:{{{name}}}:token"]

    @_coordinated
    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Take or renew lease ``name``; its fencing token, or ``None`` if someone else holds it."""
        now = "" if self._clock is None else str(int(self._clock() * 1000))
        token = self._acquire(
            keys=self._lease_keys(name), args=[holder, max(1, int(ttl_s * 1000)), now])
        return None if token is None else int(token)

    @_coordinated
    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up if ``holder`` has it; its token counter stays."""
        self._release(keys=self._lease_keys(name)[:1], args=[holder])

    @_coordinated
    def lease_token(self, name: str) -> int:
        """The newest fencing token issued for ``name`` (0: never)."""
        raw = self._r.get(self._lease_keys(name)[1])
        return 0 if raw is None else int(raw)

    @_coordinated
    def lease_holder(self, name: str) -> tuple[str, float] | None:
        """Who holds lease ``name`` and its seconds left, by the clock that times leases."""
        holder, expires = self._r.hmget(self._lease_keys(name)[0], ["holder", "expires"])
        if holder is None or expires is None:
            return None
        if self._clock is not None:
            now_ms = self._clock() * 1000
        else:
            secs, micros = self._r.time()
            now_ms = secs * 1000 + micros / 1000
        left = (int(expires) - now_ms) / 1000
        return (_text(holder), left) if left > 0 else None

    @_coordinated
    def report_follower(self, run: str, follower: str, version: int) -> None:
        """Record the version a follower runs, with the time of the report."""
        now_ms = int((self._clock or time.time)() * 1000)
        self._r.hset(self._key(run, "followers"), follower,
                     json.dumps({"version": int(version), "time_ms": now_ms}))

    @_coordinated
    def followers(self, run: str) -> dict[str, dict[str, int]]:
        """Each follower's ``version`` and ``time_ms`` of its last report."""
        out: dict[str, dict[str, int]] = {}
        for name, raw in self._r.hgetall(self._key(run, "followers")).items():
            try:
                doc = json.loads(raw)
                out[_text(name)] = {"version": int(doc["version"]), "time_ms": int(doc["time_ms"])}
            except (ValueError, KeyError, TypeError) as exc:
                raise CoordinationError(
                    f"Redis coordinator {self.url}: follower {name!r} of run {run!r} has a bad "
                    f"entry ({exc})"
                ) from exc
        return out

    @_coordinated
    def forget_follower(self, run: str, follower: str) -> bool:
        """Drop a follower's report; whether there was one."""
        return bool(self._r.hdel(self._key(run, "followers"), follower))

    def close(self) -> None:
        """Close the connection pool."""
        with contextlib.suppress(RedisError):  # a dead server's sockets: nothing to release
            self._r.close()
