"""Exporting the state at any reachable point: torch checkpoint, safetensors, or an HF dir."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from eventlog import ConfigError, RewindError
from eventlog.fold.engine import RebuiltState
from replayer.assemble import full_state
from replayer.replay import ReplayReport, state_dicts, write_checkpoint

FORMATS = ("torch", "safetensors", "hf")
#: The small state holding a Hugging Face model's config (``{"json": text}``), recorded by
#: ``rewind.integrations.hf``: an ``hf`` export writes it as ``config.json``.
HF_CONFIG = "hf_config"


def load_hook(spec: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The user's ``module:function`` that builds an HF ``config.json`` from the state dicts."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"config hook {spec!r} must look like package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config hook {spec!r} cannot be loaded: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"config hook {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def export(
    state: RebuiltState, report: ReplayReport, out: Path, fmt: str, config_hook: str | None = None
) -> list[Path]:
    """Write ``state`` in ``fmt`` under ``out``; returns the files written. A multi-rank run
    is written as one process would have recorded it: full tensors, rank 0's other states."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    state = full_state(state)
    if fmt == "torch":
        return write_checkpoint(state, report, out)
    trees = state_dicts(state, copy=False)  # (views of the state: written, not kept)
    if "model" not in trees:
        raise RewindError("the run recorded no model: nothing to export as safetensors")
    out.mkdir(parents=True, exist_ok=True)
    model, aliases = untied(trees["model"])
    metadata = {"run_id": state.run_id, "version": str(state.version), "step": str(state.step)}
    if aliases:
        metadata["aliases"] = json.dumps(aliases, sort_keys=True)
    path = out / "model.safetensors"
    # save() and our own write, not save_file(): that one renames a private (mode 0600) temp
    # file into place, while every other file written here gets the usual umask mode.
    _write_atomic(path, safetensors.torch.save(model, metadata=metadata))
    written = [path]
    text = _hf_config(trees, config_hook) if fmt == "hf" else None
    if text is not None:
        cfg = out / "config.json"
        _write_atomic(cfg, text.encode())
        written.append(cfg)
    return written


def _hf_config(trees: dict[str, Any], config_hook: str | None) -> str | None:
    """``config.json``'s text: the hook's, else the config the run recorded, else none."""
    if config_hook:
        hook = load_hook(config_hook)
        try:
            config = hook(trees)
        except Exception as exc:  # the user's code: its failure is reported as theirs, in one line
            raise ConfigError(f"config hook {config_hook!r} failed: {type(exc).__name__}: {exc}") from exc
    elif isinstance(trees.get(HF_CONFIG), dict) and isinstance(trees[HF_CONFIG].get("json"), str):
        try:
            config = json.loads(trees[HF_CONFIG]["json"])
        except ValueError as exc:
            raise RewindError(f"the run's recorded {HF_CONFIG!r} is not JSON: {exc}") from exc
    else:
        return None
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def untied(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors safetensors can store, and the names left out as aliases of a kept name.

    safetensors refuses tensors that share memory. A tied weight (an LM head that is its
    embedding) is written once, under its first name in state-dict order, as HF's
    ``save_pretrained`` does (its loaders tie the other name again); any other sharing is
    written as copies."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        view = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and view in views:
            aliases[name] = views[view]
            continue
        views[view] = name
        shared = t.numel() > 0 and ptr in storages
        storages.add(ptr)
        kept[name] = t.clone(memory_format=torch.contiguous_format) if shared else t.contiguous()
    return kept, aliases


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp name, flush it to disk, then rename it to ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
