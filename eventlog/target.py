"""Where a replay goes: ``Target``, parsed from ``latest``, ``version=V``, ``step=N``,
``gsn=G`` or ``offset=P`` (torch-free, so the CLI checks a ``--to`` before loading torch)."""

from __future__ import annotations

from dataclasses import dataclass

from eventlog.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """Where to replay to: ``latest``, or a ``version``, ``step``, ``gsn`` or control ``offset``."""

    kind: str = "latest"
    value: int | None = None

    KINDS = ("latest", "version", "step", "gsn", "offset")

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse ``latest``, ``version=V``, ``step=N``, ``gsn=G`` or ``offset=P``; any other
        text is a ``ConfigError`` (a bad argument, not a target missing from a log)."""
        if text == "latest":
            return cls()
        kind, _, raw = text.partition("=")
        if kind not in cls.KINDS[1:] or not raw.strip().lstrip("-").isdigit():
            raise ConfigError(
                f"bad replay target {text!r}: use latest, version=V, step=N, gsn=G or offset=P"
            )
        return cls(kind, int(raw))

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}={self.value}"


#: The newest sealed version.
LATEST = Target()
