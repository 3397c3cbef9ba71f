"""A data loader as a ``Recorder``'s data position (``sampler=``): torchdata's
``StatefulDataLoader``, whose ``state_dict()`` holds where the epoch is, its sampler's
generator and, with worker processes, each worker's state (the dataset's and the fetcher's,
for a dataset with ``state_dict``/``load_state_dict``) and the workers' base seed. A restore
loads it, and the next ``iter(loader)`` continues the epoch where the commit left it.

Two setups cannot resume exactly, and are refused when the ``Recorder`` is built:

* a loader without its own ``generator`` that records the global RNGs (``rng=True``): each
  ``iter(loader)`` draws its workers' base seed from the global torch RNG, so the resumed
  loop's ``iter`` would draw a number the uninterrupted run did not, after the restore put
  the global RNGs back;
* a loader without worker processes that shuffles with its own ``generator``
  (``shuffle=True, generator=g``: the sampler shares ``g``): torchdata restores ``g`` in a
  state that orders the next epoch differently. Give the sampler its own generator
  (``sampler=RandomSampler(data, generator=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from eventlog.errors import ConfigError

#: Attributes that lead from a dataloader to its samplers and generators.
_LOADER_LINKS = ("generator", "synchronized_generator", "sampler", "batch_sampler")


def generators(loader: object) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` reachable from ``loader`` through its samplers, by path
    (one held in two places, by its first path)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found[path] = obj
            return
        for link in _LOADER_LINKS:
            walk(getattr(obj, link, None), f"{path}.{link}" if path else link, depth + 1)

    walk(loader, "", 0)
    return found


def generator_states(loader: object) -> dict[str, torch.Tensor]:
    """The state of every generator of ``loader`` (``generators``), by path."""
    return {path: g.get_state() for path, g in generators(loader).items()}


def load_generators(loader: object, states: Mapping[str, torch.Tensor]) -> None:
    """Set the live generators recorded under the same path (a sampler that creates its
    generator when it is first iterated, and seeds it then, has none yet: nothing to set)."""
    for path, g in generators(loader).items():
        if path in states:
            g.set_state(states[path])


def check_data_position(sampler: Any, rng: bool) -> None:
    """Refuse a data loader recorded as ``sampler`` that would not resume exactly (module docs)."""
    if not isinstance(sampler, torch.utils.data.DataLoader):
        return
    name = type(sampler).__name__
    if rng and sampler.generator is None:
        raise ConfigError(f"Recorder(sampler=...): the {name} has no generator, so each iter() draws from "
                          "the global torch RNG, and a resumed loop would draw once more: build it with "
                          "generator=torch.Generator()")
    own = sampler.generator
    shared = own is not None and getattr(sampler.sampler, "generator", None) is own
    if sampler.num_workers == 0 and shared:
        raise ConfigError(f"Recorder(sampler=...): the {name} shuffles with its own generator and no worker "
                          "processes, which torchdata does not restore exactly: give the sampler its own "
                          "generator (sampler=RandomSampler(data, generator=torch.Generator()))")
