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

from typing import Any

import torch

from eventlog.errors import ConfigError


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
