"""Stats under load: ``/metrics`` and ``/health`` scraped from several threads while media requests
run with prefix caching on. Every scrape answers and parses, the answers are the ones the same
requests get one at a time without scrapers, and every snapshot was built on the engine thread
(the HTTP side never walks the radix tree while the engine thread changes it)."""

from __future__ import annotations

import base64
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_core.engine.stats import EngineStats
from mm_pipeline.runtime.stats import OmniStats
from tests.support.paths import SAMPLE_MEDIA as MEDIA
from tests.support.served import served_tiny_omni

SCRAPERS = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_omni(tmp_path_factory, num_full_tokens=8192, num_swa_tokens=4096, max_num_seqs=16,
                          enable_prefix_caching=True) as server:
        yield server


def conversations() -> list[list[dict]]:
    """Images (two of them twice: encoder-cache hits), audio, and text sharing a long prefix."""
    def data_url(name: str) -> str:
        return "data:application/octet-stream;base64," + base64.b64encode((MEDIA / name).read_bytes()).decode()

    system = {"role": "system", "content": "You describe media for a catalogue. " * 8}
    media = [{"type": "image_url", "image_url": {"url": data_url(n)}}
             for n in ("image_000000.webp", "image_000001.png", "image_000000.webp", "image_000001.png")]
    media.append({"type": "input_audio", "input_audio": {
        "data": base64.b64encode((MEDIA / "audio_000003.wav").read_bytes()).decode(), "format": "wav"}})
    convs = [[system, {"role": "user", "content": [part, {"type": "text", "text": f"Item {i}."}]}]
             for i, part in enumerate(media)]
    return convs + [[system, {"role": "user", "content": f"Question {i}?"}] for i in range(3)]


def answer(served, messages) -> str:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="-", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=served.engine.model_name, messages=messages, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def scrape_until(stop: threading.Event, base_url: str, errors: list[str], counts: list[int]) -> None:
    """Scrape both routes until ``stop``; ``counts`` gets the requests running at each /health."""
    with httpx.Client(base_url=base_url, timeout=30) as http:
        while not stop.is_set():
            try:
                m = http.get("/metrics")
                assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain"), m.status_code
                names = {f.name for f in text_string_to_metric_families(m.text)}
                assert {"mmserve_kv_pool_used_pages", "mmserve_running", "mmserve_prefix_cache_hit_tokens",
                        "mmserve_encoder_cache_hits"} <= names, sorted(names)
                h = http.get("/health")
                assert h.status_code == 200 and h.json()["status"] == "ok", h.text
                counts.append(h.json()["stats"]["engine_loop_requests"])
            except Exception as exc:  # collected: an assertion in a thread would be lost
                errors.append(f"{type(exc).__name__}: {exc}")


def spy_threads(monkeypatch, engine) -> list[str]:
    """Threads that build a snapshot or read the prefix cache's tree."""
    names: list[str] = []

    def spy(fn):
        def wrapped(*a, **kw):
            names.append(threading.current_thread().name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(OmniStats, "collect", classmethod(spy(OmniStats.collect.__func__)))
    monkeypatch.setattr(EngineStats, "collect", classmethod(spy(EngineStats.collect.__func__)))
    monkeypatch.setattr(engine.runtime.llm.prefix_cache, "stats", spy(engine.runtime.llm.prefix_cache.stats))
    return names


def test_scrapes_while_media_requests_run(served, monkeypatch):
    convs = conversations()
    alone = [answer(served, c) for c in convs]  # one at a time, nobody scraping
    names = spy_threads(monkeypatch, served.engine)
    stop, errors, counts = threading.Event(), [], []
    scrapers = [threading.Thread(target=scrape_until, args=(stop, served.base_url, errors, counts))
                for _ in range(SCRAPERS)]
    for t in scrapers:
        t.start()
    try:
        with ThreadPoolExecutor(len(convs)) as pool:
            together = list(pool.map(lambda c: answer(served, c), convs * 2))
    finally:
        stop.set()
        for t in scrapers:
            t.join(timeout=60)
    assert not errors, errors[:5]
    assert len(counts) >= SCRAPERS and max(counts) > 0  # scraped while requests ran
    assert together == alone * 2  # batched, cached and scraped: the same greedy answers
    assert names and set(names) == {"omni-engine"}

    deadline = time.monotonic() + 5
    while served.engine.stats().engine_loop_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    s = served.engine.stats()
    assert s.llm.prefix_cache_hit_tokens["l1"] > 0 and s.encoder_cache_hits["memory"] > 0
    text = httpx.get(served.base_url + "/metrics").text
    hits = {tuple(x.labels.items()): x.value for f in text_string_to_metric_families(text)
            if f.name == "mmserve_prefix_cache_hit_tokens" for x in f.samples}
    assert hits[(("tier", "l1"),)] > 0


def test_published_snapshot_is_immutable(served):
    s = served.engine.stats()
    assert isinstance(s, OmniStats) and isinstance(s.llm, EngineStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.requests_in_flight = 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.llm.kv_pool["swa"].used_pages = 0
    for mapping in (s.encoder_cache_hits, s.engine_loop, s.encoder, s.media, s.llm.kv_pool, s.llm.prefix_cache):
        with pytest.raises(TypeError):
            mapping["x"] = 1
    later = served.engine.stats()
    assert later.taken_at >= s.taken_at and s.to_dict()["llm"]["kv_pool"]["swa"]["total_pages"] > 0
