"""The ``rewind`` command line: demo, recovery, time travel and audit.

Every command that reads a run takes the same address options: ``--run-dir DIR`` (an
embedded run, as the demo writes it) or ``--log URL --coord URL --run ID``; ``bisect``
takes two runs, each ``DIR``, ``DIR#RUN`` or ``LOG_URL#RUN``. Commands that only read
(replay, recover, history, export, diff, bisect, plot, followers, verify) create nothing:
a log or snapshot store that does not exist is an error, not a new empty one.

Exit status, for every command: 0 success. 1 the command ran and its check failed
(``verify`` found damage, a malformed or damaged database included, ``demo`` was not
bit-exact, ``diff --exit-code`` found a difference, ``bisect`` found two runs that diverge).
2 a usage error (unknown command or option, a missing or bad value) or a Rewind error (no
such run, damaged data, an unreachable server): one line on stderr, ``error: <kind>: <what
and where>``, no traceback. 130 interrupted (Ctrl-C). Anything else is a bug.

An unreachable Kafka broker or Redis server fails within 5 seconds of the first contact.

``--json``, on every command: stdout holds one JSON object, ``{"command": NAME, "ok": BOOL,
...}``, where ``ok`` is false exactly when the exit status is 1; errors stay one line on
stderr. The other keys, per command: demo: ``bit_exact killed_at recovered_version
recovered_step final_digest_recovered final_digest_reference run_args`` (the options
that name the recorded run to the other commands). replay: ``report`` (the
replay report). recover: ``report files``. export: ``report format files``. history:
``run rows`` (each: ``kind version step gsn time_ms writer detail metrics encoding
of_raw environment``; kind: version, recovery, resume, snapshot-begin, snapshot-end).
diff: ``from to differs tensors`` (each: ``name dtype shape changed l2
bit_equal``; ``l2`` is null for tensors that cannot be compared). bisect: ``status``
(identical, diverged, differ-from-start; ``ok`` is true only for identical), ``step``,
``version_a version_b``, ``previous_step``, ``shards tensors small_states optimizer_step
hyperparameters environment layout notes replayed seconds``, ``world`` (each run's world
size there, 0 for one process), ``strict``, ``measurements measurements_step
measured_steps`` (what differs in wall-clock and other measurements only) and
``encoded_steps`` (steps equal as values, not as bytes). plot: ``run file``.
followers: ``run followers forgotten``. snapshot: ``run snapshot`` (null when nothing was
new; then also ``deleted truncated_before``, what the retention options given did).
snapshotter: ``run written``. publish: ``run dtype published keyframes last_version
payload_bytes``. verify: ``run findings`` (each: ``subject status detail``),
plus what else the patrol reports (``damaged`` records, ``failed_snapshots``, ``unreachable``).

Process-wide tuning happens here only, in the CLI's own process: ``main()`` fixes glibc's
mmap threshold (``rewind.allocator``; ``REWIND_MALLOC_MMAP_THRESHOLD=0`` leaves malloc
alone), and replays divide torch's threads among their workers
(``REWIND_REPLAY_TORCH_THREADS=0`` turns it off). Library calls change neither.
"""

# The docstring is the --help text. The modules: ``common`` (shared options, consoles, exit
# statuses), ``output`` (lines, JSON, tables), and the commands by job: ``commands_recovery``,
# ``commands_audit``, ``commands_snapshots``, ``commands_demo``; this one builds the app.

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Annotated

import typer

from eventlog import RewindError
from eventlog.version import REWIND_VERSION
from rewind.allocator import tune_for_replay
from rewind.cli.commands_audit import diff, followers, history, history_lines, plot
from rewind.cli.commands_bisect import bisect_cmd
from rewind.cli.commands_demo import demo
from rewind.cli.commands_recovery import export, recover, replay_cmd
from rewind.cli.commands_snapshots import snapshot, snapshotter_cmd, verify
from rewind.cli.commands_weights import publish
from rewind.cli.common import CHECK_FAILED, ERROR, OK, Command, Group, address_of, help_text
from rewind.cli.output import say, table_lines

__all__ = [
    "CHECK_FAILED", "ERROR", "OK", "address_of", "app", "demo", "diff", "export", "followers",
    "history", "history_lines", "main", "plot", "publish", "recover", "replay_cmd", "run", "say", "snapshot",
    "snapshotter_cmd", "table_lines", "verify",
]

app = typer.Typer(add_completion=False, help=help_text(__doc__ or ""), pretty_exceptions_enable=False,
                  cls=Group)
_COMMANDS: list[tuple[str, Callable[..., int]]] = [  # in the order of --help
    ("replay", replay_cmd), ("recover", recover), ("export", export), ("history", history), ("diff", diff),
    ("bisect", bisect_cmd),
    ("plot", plot), ("followers", followers), ("snapshot", snapshot), ("snapshotter", snapshotter_cmd),
    ("verify", verify), ("publish", publish), ("demo", demo),
]
for _name, _command in _COMMANDS:
    app.command(_name, cls=Command)(_command)
for _info in app.registered_commands:  # each command's help reflowed, as the app's is
    if _info.callback is not None and _info.help is None:
        _info.help = help_text(_info.callback.__doc__ or "")


def _print_version(value: bool) -> None:
    if value:
        print(f"rewind {REWIND_VERSION}")  # the installed distribution's (its package metadata)
        raise typer.Exit(OK)


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version, help="print the version and exit")] = False,
) -> None:
    """The options before the command's name."""


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the spaces around them) made single spaces."""
    return re.sub(r"\s*\n\s*", " ", text).strip()


def run(args: Sequence[str]) -> int:
    """Run one command line; returns its exit status (see the module docstring)."""
    args = list(args) or ["--help"]
    try:
        status = app(args=args, prog_name="rewind", standalone_mode=False)
    except RewindError as exc:
        print(f"error: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return ERROR
    except typer.TyperException as exc:  # click's usage errors (typer vendors its own click)
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "rewind"
        print(f"error: usage: {one_line(exc.format_message())} (see: {where} --help)", file=sys.stderr)
        return ERROR
    except OSError as exc:  # e.g. an --out directory that cannot be written
        print(f"error: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return ERROR
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted", file=sys.stderr)
        return 130
    return status if isinstance(status, int) else OK


def main() -> None:
    """Console-script entry point: exit 0, 1 (a check failed) or 2 (one line on stderr)."""
    tune_for_replay()  # this process is Rewind's own: let replayed payloads reuse memory
    sys.exit(run(sys.argv[1:]))
