"""Index tensors built on the host from Python ints, the fast way.

Why not ``torch.tensor(list)``: it infers a type for every element through its generic sequence
path, ~6 us for a handful of ints and ~55 us for 376 on the 2-core EPYC, and a step builds several
such tensors (slot mappings, lengths, an attention plan's rows per pool). numpy converts a list of
ints in one C loop (~2 / ~9 us) and ``torch.from_numpy`` takes its buffer without a copy; a range
becomes ``torch.arange`` (~2 us at any length). The values are the same int64 tensor either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def long_tensor(values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> torch.Tensor:
    """An int64 CPU tensor of ``values``: Python ints (rows of equal length give a 2-D tensor), a
    range, or an int64 numpy array (whose buffer the tensor then shares)."""
    if isinstance(values, range):  # (an empty one may step away from its stop: arange refuses that)
        return torch.arange(values.start, values.stop, values.step) if values else torch.empty(0, dtype=torch.long)
    return torch.from_numpy(np.asarray(values, dtype=np.int64))
