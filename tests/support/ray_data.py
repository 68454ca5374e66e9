"""A stand-in for a Ray dataset in tests that run the --ray jobs' own stages (plan, replicas,
merge) without Ray: the items the job hands to Ray Data, through its ``map_batches`` stages."""

from __future__ import annotations

import numpy as np


class InProcessDataset(list):
    """Stands for a Ray dataset: ``from_items`` keeps the items, ``map_batches`` runs the stage on
    all of them as one batch of object columns, as a replica receives them."""

    @classmethod
    def from_items(cls, items: list[dict], override_num_blocks: int | None = None) -> "InProcessDataset":
        return cls(items)

    def map_batches(self, fn, *args, fn_kwargs=None, **kwargs) -> "InProcessDataset":
        columns = {k: np.array([item[k] for item in self], dtype=object) for k in self[0]}
        out = fn(columns, **(fn_kwargs or {}))
        return InProcessDataset(dict(zip(out, row)) for row in zip(*out.values()))
