"""The version of Rewind that records a run (``RunStarted.rewind_version``).

It is the installed distribution's, from its package metadata, so ``pyproject.toml`` is the
one place a version is written.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

#: What a source tree that was never installed records: it claims no release (its code may
#: be any commit), and PEP 440 tools sort it below every release.
UNINSTALLED = "0+unknown"


def _installed() -> str:
    try:
        return version("rewind")
    except PackageNotFoundError:
        return UNINSTALLED


REWIND_VERSION = _installed()
