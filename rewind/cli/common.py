"""What every ``rewind`` command shares: the consoles, the run-address options and
``address_of``, and the exit statuses (documented in ``rewind.cli``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from eventlog import ConfigError, RunAddress

if TYPE_CHECKING:
    from eventlog import Target

#: Exit statuses (see the ``rewind.cli`` docstring).
OK, CHECK_FAILED, ERROR = 0, 1, 2


def help_text(doc: str) -> str:
    """The docstring as ``--help`` text: each paragraph one line (the terminal wraps it)."""
    return "\n\n".join(" ".join(p.split()).replace("``", "") for p in doc.strip().split("\n\n"))


def flags_as_flags(params: list[Any]) -> list[Any]:
    """``params`` with each flag (``--json``, ``--help``...) shown in help as a bare flag:
    some typer versions print a flag's type, ``--json <bool>``, as if it took a value."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """A ``rewind`` command: its help shows flags as flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return flags_as_flags(super().get_params(ctx))


class Group(TyperGroup):
    """The ``rewind`` command group: its help shows flags as flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return flags_as_flags(super().get_params(ctx))


console = Console()
err = Console(stderr=True)

RunDir = Annotated[Path | None, typer.Option("--run-dir", help="embedded run directory")]
LogUrl = Annotated[str | None, typer.Option("--log", help="log URL: sqlite://PATH or kafka://HOST:PORT")]
CoordUrl = Annotated[str | None, typer.Option("--coord", help="coordinator URL: sqlite://PATH or redis://HOST:PORT")]
RunId = Annotated[str | None, typer.Option("--run", help="run id")]
Snaps = Annotated[str | None, typer.Option(
    "--snapshots", help="snapshot store URL (file://DIR); --run-dir implies DIR/snapshots")]


def checked_target(value: str) -> str:
    """A ``--to``/``--from`` value, refused as a usage error unless it names a target."""
    from eventlog.target import Target

    try:
        Target.parse(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


To = Annotated[str, typer.Option(
    "--to", callback=checked_target, help="latest, version=V, step=N, gsn=G or offset=P")]
Workers = Annotated[int, typer.Option("--workers", min=1, help="shards replayed in parallel")]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object (shape: rewind --help)")]


def target_of(text: str) -> Target:
    """The replay target a ``--to`` or ``--from`` value names (``Target.parse``)."""
    from eventlog.target import Target

    return Target.parse(text)


def address_of(
    run_dir: Path | None, log: str | None, coord: str | None, run: str | None,
    snapshots: str | None = None, *, read_only: bool = False,
) -> RunAddress:
    """The run the address options name. ``read_only``: for a command that only reads, so
    the embedded log is opened read-only and a snapshot store given must exist."""
    if run_dir is not None:
        if log or coord:
            raise ConfigError("give either --run-dir or --log/--coord, not both")
        address = RunAddress.from_run_dir(run_dir, run)
        if snapshots is not None:
            address = dataclasses.replace(address, snapshots_url=snapshots)
    elif not log or not run:
        raise ConfigError("name a run: --run-dir DIR, or --log URL [--coord URL] --run ID")
    else:
        address = RunAddress(log, coord or log, run, snapshots)
    if read_only and snapshots is not None:
        from snapshotter.store import SnapshotStore

        root = SnapshotStore(snapshots).root
        if not root.is_dir():
            raise ConfigError(f"no snapshot store at {root}: the directory does not exist")
    return dataclasses.replace(address, read_only=read_only)
