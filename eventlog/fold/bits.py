"""A tensor's raw bits, as every fold rebuilds them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TensorBits:
    """A tensor's raw bits as the fold rebuilds them."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray
