"""The OpenAI-compatible server end to end: the real ``openai`` client against uvicorn on a free
loopback port, over an OmniEngine on a tiny random omni checkpoint (CPU, fp32).

What is proven: every modality goes through (image data URL, input_audio, video data URL and
uploaded file — equal bytes give equal answers and the second one hits the encoder cache);
streamed == not streamed; usage and logprobs are consistent; bad requests get the right status
and a message naming the problem; a client that disconnects mid-stream leaves the KV pools as
they were; 32 concurrent clients all get complete answers.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import openai
import pytest

from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.server import ServerSettings, ServerThread, create_app

from tests.support.paths import SAMPLE_MEDIA as MEDIA  # noqa: E402
GREEDY = dict(temperature=0, max_tokens=6)


def data_url(name: str, mime: str = "application/octet-stream") -> str:
    return f"data:{mime};base64," + base64.b64encode((MEDIA / name).read_bytes()).decode()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "tiny-omni", seed=0)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.runtime.config import OmniEngineConfig

    config = OmniEngineConfig.from_kwargs(num_full_tokens=8192, num_swa_tokens=4096, max_num_seqs=64,
                              limits=MediaLimits(max_bytes=256 * 1024), allowed_local_dirs=(str(MEDIA),))
    engine = OmniEngine.from_pretrained(model_dir, config)
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))
    try:
        with ServerThread(app) as server:
            server.engine = engine
            server.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
            server.model = engine.model_name
            yield server
    finally:
        engine.shutdown()


def _idle_pools(engine, timeout_s: float = 15.0) -> dict:
    """Wait until no request is live, then return per pool the pages no request holds (free or kept
    by the prefix cache, which is on by default): a leaked page makes it smaller."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats()
        if (s.requests_in_flight == 0 and s.llm.running == 0 and s.llm.queue_depth == 0
                and s.engine_loop_requests == 0):
            cached = s.llm.prefix_cache
            return {k: v.free_pages + cached.get(f"tree_{k}_pages", 0) for k, v in s.llm.kv_pool.items()}
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout_s} s: {s}")
        time.sleep(0.05)


def _chat(served, messages, **kw):
    return served.client.chat.completions.create(model=served.model, messages=messages, **{**GREEDY, **kw})


def _encoder_hits(engine) -> int:
    return sum(engine.stats().encoder_cache_hits.values())


# ---- modalities ---------------------------------------------------------------------------------
def test_image_audio_video_and_usage(served):
    text_only = _chat(served, user(text("Describe this image.")))
    image = _chat(served, user({"type": "image_url", "image_url": {"url": data_url("image_000001.png", "image/png")}},
                               text("Describe this image.")))
    wav = base64.b64encode((MEDIA / "audio_000003.wav").read_bytes()).decode()
    audio = _chat(served, user({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                               text("Describe this audio.")))
    video = _chat(served, user({"type": "video_url", "video_url": {"url": data_url("video_000000.mp4")}},
                               text("Describe this video.")))
    for r in (text_only, image, audio, video):
        assert r.choices[0].finish_reason in ("stop", "length")
        assert isinstance(r.choices[0].message.content, str)
        u = r.usage
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert 1 <= u.completion_tokens <= 6
        assert u.prompt_tokens_details.cached_tokens >= 0
    # media placeholders make the prompt longer than the text alone
    for r in (image, audio, video):
        assert r.usage.prompt_tokens > text_only.usage.prompt_tokens


def test_uploaded_video_equals_data_url_and_hits_the_cache(served):
    c = served.client
    f = c.files.create(file=("clip.mp4", (MEDIA / "video_000001.webm").read_bytes()), purpose="user_data")
    by_url = _chat(served, user({"type": "video_url", "video_url": {"url": data_url("video_000001.webm")}},
                                text("Describe this video.")))
    hits = _encoder_hits(served.engine)
    by_file = [_chat(served, user({"type": "file", "file": {"file_id": f.id}}, text("Describe this video.")))
               for _ in range(2)]
    for r in by_file:  # upload once, ask many times: same bytes -> same embeddings -> same greedy answer
        assert r.choices[0].message.content == by_url.choices[0].message.content
        assert r.usage.prompt_tokens == by_url.usage.prompt_tokens
    assert _encoder_hits(served.engine) > hits
    c.files.delete(f.id)


def test_file_url_under_allowed_dir(served):
    r = _chat(served, user({"type": "image_url", "image_url": {"url": f"file://{MEDIA / 'image_000002.jpg'}"}},
                           text("Describe this image.")))
    assert r.usage.completion_tokens >= 1


# ---- streaming, logprobs, sampling --------------------------------------------------------------
def test_stream_equals_non_stream(served):
    msgs = user({"type": "image_url", "image_url": {"url": data_url("image_000000.webp")}}, text("Describe."))
    full = _chat(served, msgs, max_tokens=8, extra_body={"ignore_eos": True})
    chunks = list(_chat(served, msgs, max_tokens=8, stream=True, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert content == full.choices[0].message.content
    assert finish == ["length"] and full.choices[0].finish_reason == "length"
    # the same prompt twice: the second (streamed) one also reuses the first one's KV
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        full.usage.model_dump(exclude={"prompt_tokens_details"})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens_details.cached_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_raw_sse_ends_with_done(served):
    body = {"model": served.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_logprobs_chat_and_completions(served):
    r = _chat(served, user(text("Say something.")), logprobs=True, top_logprobs=3, max_tokens=5,
              extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        # the engine keys top logprobs by token text, so byte tokens that decode alike merge: <= 3
        assert 1 <= len(tops) <= 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry.logprob >= tops[0] - 1e-5  # greedy picks the argmax
        assert entry.bytes == list(entry.token.encode())
    comp = served.client.completions.create(model=served.model, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                            logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert comp.usage.prompt_tokens == 4 and comp.usage.completion_tokens == 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == sorted(lp.text_offset) and all(v <= 0 for v in lp.token_logprobs)
    # streamed, the offsets go on across chunks (after the echoed prompt) as in the whole answer
    kw = dict(model=served.model, prompt="hello there", max_tokens=4, temperature=0, logprobs=1, echo=True,
              n=2, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kw)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in served.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.text_offset if c.logprobs else []
    assert [streamed[c.index] for c in whole.choices] == [c.logprobs.text_offset for c in whole.choices]
    # echo with logprobs scores the prompt too (vLLM's): its tokens lead, the first without a logprob
    echoed = whole.choices[0].logprobs
    assert echoed.text_offset[0] == 0 and echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None
    assert len(echoed.tokens) == whole.usage.prompt_tokens + 4 and all(v <= 0 for v in echoed.token_logprobs[1:])
    text_prompt = served.client.completions.create(model=served.model, prompt=["hello", "world"], max_tokens=2,
                                                   temperature=0, n=2)
    assert [c.index for c in text_prompt.choices] == [0, 1, 2, 3]


def test_seeded_sampling_is_reproducible(served):
    kw = dict(temperature=1.0, top_p=0.9, seed=1234, n=2, max_tokens=6, extra_body={"ignore_eos": True})
    a = _chat(served, user(text("Tell me a story.")), **kw)
    b = _chat(served, user(text("Tell me a story.")), **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2 and a.usage.completion_tokens == 12


# ---- errors -------------------------------------------------------------------------------------
def _status(fn) -> tuple[int, str]:
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value.status_code, e.value.body["message"]


def _error(fn) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value.status_code, e.value.body


def test_bad_requests_get_the_right_status(served):
    c = served.client
    img = lambda url: user({"type": "image_url", "image_url": {"url": url}}, text("x"))  # noqa: E731
    code, msg = _status(lambda: c.chat.completions.create(model=served.model, messages=[]))
    assert code == 400 and "messages" in msg
    code, msg = _status(lambda: _chat(served, img("data:image/png;base64,@@not-base64@@")))
    assert code == 400 and "base64" in msg
    code, msg = _status(lambda: _chat(served, img(data_url("audio_000003.wav"))))
    assert code == 415 and "image" in msg
    code, msg = _status(lambda: _chat(served, img("data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 300_000).decode())))
    assert code == 413
    code, msg = _status(lambda: _chat(served, img("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode())))
    assert code == 400
    code, msg = _status(lambda: _chat(served, img("file:///etc/passwd")))
    assert code == 403
    code, msg = _status(lambda: _chat(served, user({"type": "file", "file": {"file_id": "file-nope"}}, text("x"))))
    assert code == 404 and "file-nope" in msg
    code, msg = _status(lambda: c.chat.completions.create(model="other", messages=user(text("x"))))
    assert code == 404 and "other" in msg
    code, msg = _status(lambda: _chat(served, user(text("x")), temperature=3))
    assert code == 400 and "temperature" in msg
    code, err = _error(lambda: c.completions.create(model=served.model, prompt=[3] * 5000, max_tokens=2))
    assert code == 400 and "context" in err["message"]
    assert err["code"] == "context_length_exceeded" and err["kind"] == "context_length"
    assert _idle_pools(served.engine)  # nothing leaked by the failures


# ---- disconnects and concurrency ----------------------------------------------------------------
def test_disconnect_mid_stream_frees_everything(served):
    before = _idle_pools(served.engine)
    body = {"model": served.model, "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": user({"type": "video_url", "video_url": {"url": data_url("video_000000.mp4")}}, text("go"))}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", served.base_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert served.engine.stats().engine_loop_requests >= 1  # still generating when we hang up
    assert _idle_pools(served.engine) == before


def test_disconnect_before_the_answer_frees_everything(served):
    """A non-streamed request whose client gives up (read timeout) is aborted, not finished."""
    before = _idle_pools(served.engine)
    body = {"model": served.model, "max_tokens": 800, "ignore_eos": True,
            "messages": user({"type": "image_url", "image_url": {"url": data_url("image_000001.png")}}, text("go"))}
    # the read timeout must be well under the whole answer's time: 800 steps of this tiny model took
    # under 0.5 s once the decode step got faster (issue 17), so the client now gives up after 0.15 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.15))
    steps = served.engine.stats().engine_loop["steps"]
    assert _idle_pools(served.engine) == before
    # aborted: it stopped long before 800 decode steps
    assert served.engine.stats().engine_loop["steps"] - steps < 700


def test_32_concurrent_clients(served):
    before = _idle_pools(served.engine)
    client = openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="-", max_retries=0, timeout=120)
    images = [data_url(n) for n in ("image_000000.webp", "image_000001.png", "image_000002.jpg")]

    async def one(i: int):
        parts = [text(f"request {i}")]
        if i % 2:
            parts.insert(0, {"type": "image_url", "image_url": {"url": images[i % 3]}})
        kw = dict(model=served.model, messages=user(*parts), max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        if i % 4 == 3:
            chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        r = await client.chat.completions.create(**kw)
        assert r.usage.completion_tokens == 5
        return r.choices[0].message.content

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    answers = asyncio.run(all_of_them())
    assert len(answers) == 32 and all(isinstance(a, str) for a in answers)
    # same image + same text -> same greedy answer, batched or not
    solo = _chat(served, user({"type": "image_url", "image_url": {"url": images[1]}}, text("request 1")),
                 max_tokens=5, extra_body={"ignore_eos": True})
    assert answers[1] == solo.choices[0].message.content
    assert _idle_pools(served.engine) == before


def test_overload_is_429_with_retry_after(model_dir, tmp_path):
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.runtime.config import OmniEngineConfig

    engine = OmniEngine.from_pretrained(model_dir, OmniEngineConfig.from_kwargs(num_full_tokens=2048, max_queue=1))
    try:
        with ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path)))) as server:
            body = {"model": engine.model_name, "stream": True, "max_tokens": 500, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "hold the only slot"}]}
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", server.base_url + "/v1/chat/completions", json=body) as held:
                    assert held.status_code == 200
                    r = http.post(server.base_url + "/v1/chat/completions", json={**body, "stream": False})
                    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                    assert r.json()["error"]["type"] == "rate_limit_error" and "max_queue" in r.json()["error"]["message"]
            _idle_pools(engine)
            r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 200  # the slot came back when the first client hung up
    finally:
        engine.shutdown()


def test_cli_serve_subprocess(model_dir):
    import signal
    import subprocess
    import sys

    from mm_pipeline.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mm_pipeline.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--api-key", "sk-cli", "--kv-tokens", "2048", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() >= deadline:
                # read its output only once it has ended: a read of a running server's pipe waits
                # for an end that never comes, and the test hung instead of failing
                proc.kill()
                pytest.fail(f"mmserve serve not up in 60 s (exit {proc.wait()}): {proc.communicate()[0]}")
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0)
        r = c.chat.completions.create(model=model_dir.name, messages=user(text("hi")), max_tokens=3)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
    # start-up says what a user needs, and transformers says nothing about our model type
    startup = proc.stdout.read()
    for line in (f"model     tiny-omni ({model_dir})", "device    cpu, float32", "KV pools  Full 2,048 tokens (",
                 "context   ", "prefix caching on (", "threads   engine thread ",
                 f"serving   tiny-omni on http://127.0.0.1:{port}/v1"):
        assert line in startup, (line, startup)
    assert "model of type" not in startup and "rope_scaling" not in startup, startup


def test_models_health_metrics(served):
    # one request of its own: under pytest-xdist this test may be the first (or only) one of its
    # module on a worker, and the TTFT count below must not depend on which tests ran before it
    served.client.completions.create(model=served.model, prompt=[5, 6, 7], max_tokens=1, temperature=0)
    assert [m.id for m in served.client.models.list().data] == [served.model]
    card = httpx.get(served.base_url + f"/v1/models/{served.model}").json()  # vLLM's fields clients size prompts by
    assert card["max_model_len"] == served.engine.max_model_len > 0 and card["root"] == served.model
    health = httpx.get(served.base_url + "/health").json()
    assert health["status"] == "ok" and health["stats"]["llm"]["kv_pool"]["full"]["total_pages"] > 0
    assert httpx.get(served.base_url + "/openapi.json").status_code == 200  # Starlette's own route: its template
    text_ = httpx.get(served.base_url + "/metrics").text
    assert 'mmserve_requests_total{endpoint="/openapi.json",status="200"}' in text_
    for name in ("mmserve_time_to_first_token_seconds_count", "mmserve_request_time_per_output_token_seconds_bucket",
                 'mmserve_kv_pool_free_pages{pool="full"}', 'mmserve_kv_pool_free_pages{pool="swa"}',
                 "mmserve_queue_depth", "mmserve_running", "mmserve_event_loop_lag_seconds_bucket",
                 'mmserve_encoder_cache_hits_total{tier=', 'mmserve_requests_total{endpoint="/health",status="200"}'):
        assert name in text_, name
    ttft_count = [ln for ln in text_.splitlines() if ln.startswith("mmserve_time_to_first_token_seconds_count")]
    assert int(float(ttft_count[0].split()[-1])) > 0
