"""The driver side of a Ray job without a cluster: result rows folded into per-replica stats as
they arrive (Ray Data stood in for by a list of result blocks), and the job's read-ahead window."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mm_pipeline.cluster.distributed_job import RayJobConfig, configure_data, run_replicas
from mm_pipeline.cluster.job_replica import RESULT_COLUMNS


def _block(rows: list[tuple]) -> dict[str, np.ndarray]:
    """A result block as replicas return it: (key, error, replica, node, pid, start, end, cache) per row."""
    cols = {c: [] for c in RESULT_COLUMNS}
    for key, error, replica, node, pid, start, end, cache in rows:
        for c, v in zip(RESULT_COLUMNS, (key, error, 2, False, replica, node, pid, start, end, json.dumps(cache))):
            cols[c].append(v)
    return {c: np.array(v, dtype=object) for c, v in cols.items()}


class _Results:
    """Stands for ``ds.map_batches(Replica, ...)``: its result blocks, in arrival order."""

    def __init__(self, blocks: list[dict[str, np.ndarray]]) -> None:
        self.blocks = blocks

    def map_batches(self, *args, **kwargs) -> "_Results":
        return self

    def iter_batches(self, **kwargs):
        yield from self.blocks


def test_batch_reports_are_folded_as_they_arrive(monkeypatch):
    """Blocks join batches (b1 and b2 of replica A) and split them (A's b3 in two blocks), arrive
    out of order, and a replica restarts on another node (pid 2): the stats are the batches'."""
    pytest.importorskip("ray")
    hits = {"encoder_cache_hits.memory": 1}
    blocks = [
        _block([("k1", "", "A", "n1", 1, 0.0, 2.0, hits), ("k2", "bad", "A", "n1", 1, 0.0, 2.0, hits),
                ("k3", "", "A", "n1", 1, 1.0, 3.0, {"encoder_cache_hits.memory": 4})]),
        _block([("k4", "", "A", "n2", 2, 9.0, 10.0, hits), ("k5", "", "B", "n1", 7, 0.5, 1.5, {})]),
        _block([("k6", "", "A", "n1", 1, 4.0, 5.0, {"encoder_cache_hits.memory": 5}),
                ("k1", "", "A", "n1", 1, 4.0, 5.0, hits)]),  # k1 again: a duplicate result, not counted
        _block([("k7", "oops", "A", "n1", 1, 4.0, 5.0, {"encoder_cache_hits.memory": 5})]),  # b3, second piece
    ]
    seen: list[tuple] = []
    result = run_replicas(_Results(blocks), object, {}, RayJobConfig(), on_result=lambda *r: seen.append(r))
    assert [k for k, _, _ in seen] == ["k1", "k2", "k3", "k4", "k5", "k6", "k7"]
    assert (result.results, result.duplicate_results) == (8, 1)
    a, b = result.replicas
    assert (a.replica, a.items, a.failed, a.restarts) == ("A", 6, 2, 1)
    assert a.node == "n2"  # where its latest batch ran (the restarted process), though it came early
    assert a.busy_s == pytest.approx(3.0 + 1.0 + 1.0)  # [0, 3], [4, 5] (two pieces, once), [9, 10]
    assert a.cache == {"encoder_cache_hits.memory": 5 + 1}  # per process: the largest, then summed
    assert (b.items, b.failed, b.node) == (1, 0, "n1")


def test_a_job_sets_its_read_window_and_the_next_one_does_not_inherit_it():
    """Ray Data's own limit is a share of the object store: the reads of a big batch file, or of a
    directory of videos behind slow replicas, ran ahead until most of it sat there.  Every job
    gives a byte limit, replicas x its read-ahead (RayJobConfig.read_ahead_bytes, else the job's
    default); the context is the process's, so each job sets its own."""
    pytest.importorskip("ray")
    from ray.data import DataContext

    ctx = DataContext.get_current()
    before = (ctx.execution_options.resource_limits, ctx.wait_for_min_actors_s, ctx.enable_progress_bars)
    try:
        configure_data(RayJobConfig(replicas=3), 64 << 20)  # the job's default
        assert ctx.execution_options.resource_limits.object_store_memory == 3 * (64 << 20)
        configure_data(RayJobConfig(replicas=2, read_ahead_bytes=5 << 20), 64 << 20)  # the config's
        assert ctx.execution_options.resource_limits.object_store_memory == 2 * (5 << 20)
    finally:  # leave the process's context as the other tests found it
        ctx.execution_options.resource_limits, ctx.wait_for_min_actors_s, ctx.enable_progress_bars = before


@pytest.mark.parametrize("value", [0, -1, 1.5, 4.0, True, "4"])
def test_read_ahead_is_a_positive_whole_number_of_bytes(value):
    message = f"read_ahead_bytes must be a whole number of bytes >= 1 per replica (None: the job's default), got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        RayJobConfig(read_ahead_bytes=value)


def test_read_ahead_defaults_and_overrides():
    from mm_pipeline.cluster.caption_dataset import READ_AHEAD_BYTES, default_read_ahead

    assert RayJobConfig().read_ahead_bytes is None and RayJobConfig(read_ahead_bytes=1).read_ahead_bytes == 1
    assert RayJobConfig(replicas=4).object_store_bytes(7) == 28
    assert RayJobConfig(replicas=4, read_ahead_bytes=3).object_store_bytes(7) == 12
    # caption: 512 MiB a replica, or two inputs at the media byte limit when that is more
    assert READ_AHEAD_BYTES == 512 << 20
    assert default_read_ahead(128 << 20) == default_read_ahead(None) == 512 << 20
    assert default_read_ahead(1 << 30) == 2 << 30
