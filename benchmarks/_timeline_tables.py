"""The pipeline benchmark's stage-timeline tables: one cold long-video request, streamed and with
``--no-stream-embeddings``, side by side (decode / encode / prefill spans and how long stages overlapped)."""

from __future__ import annotations

from _common import print_table


def print_timeline(results: dict[str, float]) -> None:
    """The stage tables of ``timeline_of_one``, streamed and --no-stream-embeddings (medians when
    repeated)."""
    for mode, p in (("streamed", "timeline_"), ("--no-stream-embeddings", "no_stream_timeline_")):
        rows = [(st, results[f"{p}{st}_first_s"], results[f"{p}{st}_last_s"], results[f"{p}{st}_busy_s"],
                 results[f"{p}{st}_spans"]) for st in ("decode", "encode", "prefill")]
        print_table(f"stage timeline of one cold long-video request, {mode} (first token at "
                    f"{results[p + 'ttft_s']:.2f} s, {results[p + 'tail_s'] * 1000:.0f} ms after the last "
                    f"decoded chunk)",
                    ["stage", "first start s", "last end s", "busy s", "spans"], rows)
    pairs = [(k[len("timeline_"):-len("_overlap_s")].replace("_", " + "), v, results[f"no_stream_{k}"])
             for k, v in results.items() if k.startswith("timeline_") and k.endswith("_overlap_s")]
    print_table("stages busy at the same time", ["stages", "streamed s", "no-stream s"], pairs)
