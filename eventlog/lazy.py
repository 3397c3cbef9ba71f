"""Lazy exports for a package's ``__init__`` (PEP 562): each name is imported from its module
on first use, so importing the package (as the ``rewind`` CLI does for ``--help``) loads no
torch until a name that needs it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any], sources: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace``: the names in ``sources`` (module -> names) load on first access and are
    then kept in ``namespace``, so later lookups are plain ones. Any other name raises
    ``AttributeError`` (which lets ``from package import submodule`` import the submodule)."""
    home = {name: module for module, names in sources.items() for name in names}
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *home})

    return __getattr__, __dir__
