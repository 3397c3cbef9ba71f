"""msgpack codec for small states (RNG, scheduler, sampler, custom ``Stateful`` objects).

Plain msgpack loses types that training state relies on, so three ext types are declared:
tuples (``random.getstate()``), numpy arrays (``np.random.get_state()``) and torch tensors
(``torch.Generator.get_state()``). Decoding is strict: bounded sizes, only these ext types,
and every array header is checked before any allocation. No pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from eventlog.errors import DecodeError
from eventlog.settings import current
from eventlog.tensorcodec import DTYPES, dtype_name, nbytes_of

_EXT_TUPLE = 1
_EXT_NDARRAY = 2
_EXT_TENSOR = 3
_EXT_TENSOR_REF = 4
_EXT_BIGINT = 5  # ints beyond 64 bits: numpy's PCG64 state holds 128-bit ones
_MAX_BIGINT_BYTES = 64
_NUMPY_DTYPES = {np.dtype(n).str for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)}


@dataclass(frozen=True)
class TensorRef:
    """Stands in a state skeleton for the log tensor called ``name``."""

    name: str


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR_REF, obj.name.encode())
    if type(obj) is int:  # msgpack hands over only the ints it cannot hold itself
        n = (obj.bit_length() + 8) // 8
        if n > _MAX_BIGINT_BYTES:
            raise DecodeError(f"integer of {obj.bit_length()} bits is too large to record")
        return msgpack.ExtType(_EXT_BIGINT, obj.to_bytes(n, "little", signed=True))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgpack.ExtType(_EXT_TENSOR, pack([dtype_name(t.dtype), list(t.shape), raw]))
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj).reshape(obj.shape)  # ascontiguousarray makes 0-d arrays 1-d
        if a.dtype.str not in _NUMPY_DTYPES and a.dtype.str.replace(">", "<") not in _NUMPY_DTYPES:
            raise DecodeError(f"numpy dtype {a.dtype} cannot be recorded")
        return msgpack.ExtType(_EXT_NDARRAY, pack([a.dtype.str, list(a.shape), a.tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot record a {type(obj).__name__} in a small state")


def pack(obj: Any) -> bytes:
    """Encode a state tree (dicts, lists, tuples, scalars, bytes, arrays, tensors)."""
    try:
        packed: bytes = msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)
        return packed
    except (TypeError, ValueError, OverflowError) as exc:
        raise DecodeError(f"state cannot be recorded: {exc}") from exc


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise DecodeError(f"{where}: bad array shape {value!r}")
    return tuple(value)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        items = unpack(data, "tuple")
        if not isinstance(items, list):
            raise DecodeError("tuple ext does not hold a list")
        return tuple(items)
    if code == _EXT_BIGINT:
        if not 0 < len(data) <= _MAX_BIGINT_BYTES:
            raise DecodeError(f"big integer ext of {len(data)} bytes")
        return int.from_bytes(data, "little", signed=True)
    if code == _EXT_TENSOR_REF:
        try:
            return TensorRef(data.decode())
        except UnicodeDecodeError:
            raise DecodeError("tensor reference is not UTF-8") from None
    if code in (_EXT_NDARRAY, _EXT_TENSOR):
        header = unpack(data, "array")
        if not (isinstance(header, list) and len(header) == 3 and isinstance(header[2], bytes)):
            raise DecodeError("array ext is not [dtype, shape, bytes]")
        dt, shape, raw = header[0], _shape(header[1], "array ext"), header[2]
        if code == _EXT_TENSOR:
            if dt not in DTYPES:
                raise DecodeError(f"tensor ext: unknown dtype {dt!r}")
            if nbytes_of(dt, shape) != len(raw):
                raise DecodeError(f"tensor ext: {len(raw)} bytes do not fill shape {shape} of {dt}")
            t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                 else torch.empty(0, dtype=torch.uint8))
            return t.view(DTYPES[dt]).reshape(shape)
        if dt not in _NUMPY_DTYPES and not (isinstance(dt, str) and dt.replace(">", "<") in _NUMPY_DTYPES):
            raise DecodeError(f"ndarray ext: dtype {dt!r} not allowed")
        n = np.dtype(dt).itemsize * int(np.prod(shape, dtype=np.int64))
        if n != len(raw):
            raise DecodeError(f"ndarray ext: {len(raw)} bytes do not fill shape {shape} of {dt}")
        return np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape).copy()
    raise DecodeError(f"undeclared msgpack ext type {code}")


def unpack(data: bytes, where: str = "small state") -> Any:
    """Decode a state tree, or raise ``DecodeError`` naming ``where``."""
    most = current().max_small_state_bytes
    if len(data) > most:
        raise DecodeError(f"{where}: {len(data)} bytes exceeds the small-state limit of {most} "
                          "(REWIND_MAX_SMALL_STATE_BYTES)")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            ext_hook=_ext_hook,
        )  # unpackb bounds every str/bin/array/map by len(data), itself bounded above
    except DecodeError as exc:
        raise DecodeError(f"{where}: {exc}") from exc
    except Exception as exc:  # msgpack raises several kinds on garbage
        raise DecodeError(f"{where}: not valid msgpack ({type(exc).__name__}: {exc})") from exc
