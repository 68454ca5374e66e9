"""The job summaries count every failure but keep only the ones they print: a job of millions of
failing inputs (a batch file of a wrong url, a folder of unreadable files) kept a message per
failure in the driver until the end, and the caption summary printed them all."""

from __future__ import annotations

from mm_pipeline.jobs.batch import BatchSummary
from mm_pipeline.jobs.caption import CaptionSummary


def test_the_batch_summary_keeps_the_failures_it_names():
    summary = BatchSummary(total=10_002)
    for i in range(10_000):
        summary.add(f"req-{i}", f"url '/v1/nope' is not one of [...] ({i})")
    summary.add("ok-1", None)
    summary.add(None, "line 7: not JSON")
    assert (summary.succeeded, summary.failed) == (1, 10_001)
    assert len(summary.failures) == 20  # the ones lines() prints
    lines = summary.lines()
    assert lines[0].startswith("batch: 1 succeeded, 10001 failed of 10002 requests")
    assert lines[1] == "  req-0: url '/v1/nope' is not one of [...] (0)"
    assert lines[-1] == "  ... and 9981 more" and len(lines) == 1 + 20 + 1


def test_the_caption_summary_keeps_the_failures_it_names():
    summary = CaptionSummary(total=5_000)
    for i in range(5_000):
        summary.add(f"/data/{i}.png", "UnsupportedMediaType: not an image", 0)
    assert summary.failed == 5_000 and len(summary.failures) == 20
    lines = summary.lines()
    assert "5000 failed:" in lines and lines[-1] == "  ... and 4980 more"
    assert len(lines) == 1 + 1 + 20 + 1  # totals, "N failed:", the first 20, the rest counted
    few = CaptionSummary(total=2)
    few.add("a.png", "broken", 0)
    assert few.lines()[-2:] == ["1 failed:", "  a.png: broken"]  # all named: no "more" line
