"""Decoding an http(s) video while it arrives, through the server (issue 16 item 4).

What is proven, with a throttled loopback media host: the answer (greedy tokens; logprobs to float
tolerance) with --decode-while-receiving equals the one with --no-decode-while-receiving; the early path was taken
(counters on /metrics: one early decode, bytes still outstanding when it started, frames served
from it; a video's sound track from its own early reader); the same URL again hits the cache, and its early decode is cancelled unused; a sender that disconnects or stalls mid-body gets a 4xx and leaves no decoder thread.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from samples.synthetic.throttled_http import ThrottledMediaServer, remux_layout
from tests.support.media_samples import audio_bytes, video_bytes
from tests.support.served import served_tiny_omni, wait_idle


def _ask(server, url: str) -> httpx.Response:
    body = {"model": server.engine.model_name, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "Describe this video."}]}]}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def _early_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mmserve-early-decode"]


def _assert_early_threads_end(seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while _early_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _early_threads() == []


def _media_metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            if f.name.startswith("mmserve_media_early") for s in f.samples}


@pytest.fixture(scope="module")
def clip() -> bytes:
    return remux_layout(video_bytes("mp4", fps=10, n_frames=100, size=(64, 48), gop=10), "index")


def _served(tmp_path_factory, on: bool, knob: str = "decode_while_receiving"):
    return served_tiny_omni(tmp_path_factory, allow_http=True, allowed_domains=("127.0.0.1",),
                            allow_private_hosts=True, fetch_timeout_s=3.0, **{knob: on})


def _each_mode(tmp_path_factory, name: str, data: bytes, knob: str = "decode_while_receiving"):
    """(on, server, url, host): the config field ``knob`` on, then off; ``data`` sent at ``name``
    over ~0.6 s by ``host``."""
    with ThrottledMediaServer({name: data}, rate_bytes_s=len(data) / 0.6, chunk=4096) as media:
        for on in (True, False):
            with _served(tmp_path_factory, on, knob) as server:
                yield on, server, media.url(name), media


def test_same_answer_with_and_without_and_counters(tmp_path_factory, clip) -> None:
    answers = {}
    for on, server, url, _ in _each_mode(tmp_path_factory, "/clip.mp4", clip):
        r = _ask(server, url)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answers[on] = (choice["message"]["content"],
                       [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]])
        media_counts = server.engine.stats().media
        if on:
            metrics = _media_metrics(server)
            assert metrics[("mmserve_media_early_decodes_total", (("kind", "video"),))] == 1
            assert metrics[("mmserve_media_early_decode_bytes_outstanding_total", ())] > 0
            used = media_counts.get("early_frames_used", 0)
            assert used > 0
            # the tails of keyframe spans after their last sampled frame were never decoded
            assert metrics[("mmserve_media_early_packets_skipped_total", ())] > 0
            assert 0 < media_counts["early_frames_decoded"] < 100
            # the same bytes again: the cache holds every unit, so the second early decode
            # is cancelled when the hash completes and serves nothing
            again = _ask(server, url)
            assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
            counts = server.engine.stats().media
            assert counts["early_decodes.video"] == 2 and counts["early_frames_used"] == used
            _assert_early_threads_end()
        else:
            assert not any(k.startswith("early_") for k in media_counts)
    (text_on, lp_on), (text_off, lp_off) = answers[True], answers[False]
    assert text_on == text_off and [t for t, _ in lp_on] == [t for t, _ in lp_off]
    # the same frames and tokens; logprobs only to float tolerance (prefill chunk boundaries
    # follow when each unit is ready, which moves the last bits of a sum)
    assert [lp for _, lp in lp_on] == pytest.approx([lp for _, lp in lp_off], abs=1e-4)


def test_sender_that_disconnects_or_stalls(tmp_path_factory, clip) -> None:
    with ThrottledMediaServer({"/clip.mp4": clip}, rate_bytes_s=len(clip) / 0.5, chunk=4096,
                              stall_s=20.0) as media, _served(tmp_path_factory, True) as server:
        for path in ("/cut/clip.mp4", "/stall/clip.mp4"):
            t0 = time.monotonic()
            r = _ask(server, media.url(path))
            assert 400 <= r.status_code < 500, r.text
            assert time.monotonic() - t0 < 15  # the fetch deadline (3 s), not the sender's stall
        _assert_early_threads_end()
        # and a whole body still works afterwards (the decoder slots came back)
        assert _ask(server, media.url("/clip.mp4")).status_code == 200


def test_audio_decoded_while_it_arrives(tmp_path_factory) -> None:
    mp3 = audio_bytes("mp3", "libmp3lame", 44100, 4.0)
    body = lambda server, url: {  # noqa: E731
        "model": server.engine.model_name, "temperature": 0, "max_tokens": 6,
        "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}},
                                                  {"type": "text", "text": "What do you hear?"}]}]}
    answers = {}
    with ThrottledMediaServer({"/a.mp3": mp3}, rate_bytes_s=len(mp3) / 0.5, chunk=2048) as media:
        for on in (True, False):
            with _served(tmp_path_factory, on) as server:
                r = httpx.post(server.base_url + "/v1/chat/completions", json=body(server, media.url("/a.mp3")),
                               timeout=60)
                assert r.status_code == 200, r.text
                answers[on] = r.json()["choices"][0]["message"]["content"]
                counts = server.engine.stats().media
                if on:
                    assert counts["early_decodes.audio"] == 1 and counts["early_audio_used"] == 1
                    # the same bytes again: every unit is cached, the early decode is cancelled unused
                    again = httpx.post(server.base_url + "/v1/chat/completions",
                                       json=body(server, media.url("/a.mp3")), timeout=60)
                    assert again.json()["choices"][0]["message"]["content"] == answers[on]
                    counts = server.engine.stats().media
                    assert counts["early_decodes.audio"] == 2 and counts["early_audio_used"] == 1
                else:
                    assert not any(k.startswith("early_") for k in counts)
                wait_idle(server)
    assert answers[True] == answers[False]


def test_a_videos_sound_decoded_while_it_arrives(tmp_path_factory) -> None:
    """A video with a sound track (the tiny model hears videos): the same answer with and without;
    the sound's samples came from the early decode (early_sound_used), the frames too; the same
    URL again is a cache hit whose early decodes (frames and sound) are cancelled unused."""
    clip = remux_layout(video_bytes("mp4", fps=10, n_frames=60, size=(64, 48), gop=10, with_audio=True), "index")
    answers = {}
    for on, server, url, _ in _each_mode(tmp_path_factory, "/v.mp4", clip):
        r = _ask(server, url)
        assert r.status_code == 200, r.text
        answers[on] = r.json()["choices"][0]["message"]["content"]
        counts = server.engine.stats().media
        if on:
            assert counts["early_decodes.video"] == 1 and counts["early_sound_used"] == 1
            assert counts.get("early_frames_used", 0) > 0 and "early_audio_used" not in counts
            assert _ask(server, url).json()["choices"][0]["message"]["content"] == answers[on]
            counts = server.engine.stats().media
            assert counts["early_decodes.video"] == 2 and counts["early_sound_used"] == 1
            _assert_early_threads_end()
        else:
            assert not any(k.startswith("early_") for k in counts)
        wait_idle(server)
    assert answers[True] == answers[False]


def test_index_at_the_end_fetched_first(tmp_path_factory) -> None:
    """moov after mdat (FFmpeg's default MP4): with the index fetched from the end (the default)
    the early decoder serves frames and the answer equals --no-fetch-index-from-end's."""
    clip = remux_layout(video_bytes("mp4", fps=10, n_frames=100, size=(320, 240), gop=10), "index-at-end")
    answers, ranges = {}, {}
    for on, server, url, media in _each_mode(tmp_path_factory, "/end.mp4", clip, "fetch_index_from_end"):
        r = _ask(server, url)
        assert r.status_code == 200, r.text
        answers[on], ranges[on] = r.json()["choices"][0]["message"]["content"], media.range_requests
        counts = server.engine.stats().media
        if on:
            assert counts["index_from_end"] == 1 and counts["early_decodes.video"] == 1
            assert counts.get("early_frames_used", 0) > 0 and "index_from_end_mismatches" not in counts
            _assert_early_threads_end()
        else:
            assert not any(k.startswith(("early_", "index_from_end")) for k in counts)
        wait_idle(server)
    assert ranges == {True: 1, False: 1}  # one range request, by the server with the feature on
    assert answers[True] == answers[False]

