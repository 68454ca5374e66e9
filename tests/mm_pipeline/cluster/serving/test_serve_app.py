"""``serve --ray`` end to end on a local Ray cluster (the session's ``ray_local``, 127.0.0.1): one Serve
app for the module, 2 LLM replicas and 2 encoder replicas of the demo model (a quarter CPU and one torch
thread each) behind our FastAPI app as the ingress, asked with the ``openai`` client; the encoder tier
hands embeddings over through an encoder-cache directory all replicas see.

* image, audio, video, an uploaded file and a stream give the answers of one process (greedy);
* /tokenize (a chat with an image, a text), /detokenize and /version answer as one process;
* a bad media item is the same 415 as one process (typed errors cross the replica boundary);
* the calls of one request (``n`` choices, several media items) are each routed, not stuck;
* repeated media goes to the same encoder replica, which finds it cached; different media spread;
* a conversation's turns land on one replica (each turn's cached tokens cover the previous prompt),
  and a second question about the same video hits that replica's encoder cache;
* /metrics has a series per LLM replica (each engine family labelled with its replica);
* killing an LLM replica under load loses no request and hangs none; Serve starts a new one.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import shutil
import socket
import time

import pytest

from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.server.launch.listen import Listen
from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]
openai = pytest.importorskip("openai")

MEDIA = {"image": "image_000001.png", "audio": "audio_000003.wav", "video": "video_000000.mp4"}
ENGINE = dict(device="cpu", dtype="float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part(kind: str) -> dict:
    data = base64.b64encode((SAMPLE_MEDIA / MEDIA[kind]).read_bytes()).decode()
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return {"type": f"{kind}_url", f"{kind}_url": {"url": f"data:application/octet-stream;base64,{data}"}}


@pytest.fixture(scope="module")
def cluster_url(ray_local, tmp_path_factory, request):
    """The router keeps its tree in the session's throwaway Redis when redis-server is installed
    (as a deployment with several ingresses would), else in the ingress."""
    from ray import serve

    from mm_pipeline.cluster.serving.serve_app import ServeClusterConfig, start, stop
    from mm_pipeline.server.settings import ServerSettings

    try:
        router_redis_url = f"redis://127.0.0.1:{request.getfixturevalue('redis_server')}/0"
    except pytest.skip.Exception:
        router_redis_url = None
    cluster = ServeClusterConfig(llm_replicas=2, encoder_replicas=2, llm_num_cpus=0.25, encoder_num_cpus=0.25,
                                 ingress_num_cpus=0.25, torch_threads=1, listen=Listen(port=_free_port()), routing_stats_period_s=0.2,
                                 router_redis_url=router_redis_url)
    settings = ServerSettings(files_dir=str(tmp_path_factory.mktemp("ray-files")))
    config = OmniEngineConfig.from_kwargs(cache_dir=str(tmp_path_factory.mktemp("encoder-cache")), **ENGINE)
    start(DEMO_MODEL, config, settings, cluster)
    try:
        yield cluster.listen.base_url
    finally:
        stop(cluster)
        serve.shutdown()


@pytest.fixture(scope="module")
def local_url(tmp_path_factory):
    """The same model in this process: the answers the cluster must give."""
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.server import ServerSettings, ServerThread, create_app

    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(**ENGINE))
    try:
        with ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))) as s:
            yield s.base_url
    finally:
        engine.shutdown()


def client(url: str, **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, **kw)


def ask(c, content, max_tokens: int = 10, **kw):
    return c.chat.completions.with_raw_response.create(
        model="demo-model", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": content}], **kw)


def test_openai_answers_equal_one_process(cluster_url, local_url):
    remote, local = client(cluster_url), client(local_url)
    for kind in MEDIA:
        content = [part(kind), {"type": "text", "text": f"Describe this {kind}."}]
        assert ask(remote, content).parse().choices[0].message.content == \
            ask(local, content).parse().choices[0].message.content, kind
    # an upload, asked by file id (the ingress ships the bytes to the replica)
    payload = (SAMPLE_MEDIA / MEDIA["image"]).read_bytes()
    answers = []
    for c in (remote, local):
        f = c.files.create(file=("pic.png", payload), purpose="user_data")
        answers.append(ask(c, [{"type": "file", "file": {"file_id": f.id}},
                               {"type": "text", "text": "What is in the file?"}]).parse().choices[0].message.content)
    assert answers[0] == answers[1] and answers[0]
    # a stream, token by token over SSE through Serve's proxy
    texts = []
    for c in (remote, local):
        stream = c.chat.completions.create(model="demo-model", max_tokens=12, temperature=0, stream=True,
                                           messages=[{"role": "user", "content": "Say something."}])
        texts.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    assert texts[0] == texts[1] and texts[0]


def test_structured_outputs_equal_one_process(cluster_url, local_url):
    """A constraint travels to the LLM replica with its request (compiled there): the same answer as
    one process, and a bad one is the same 400."""
    import httpx

    body = {"model": "demo-model", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Pick a color."}],
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "required": ["color"], "additionalProperties": False,
                "properties": {"color": {"enum": ["red", "green"]}}}}}}
    answers = [httpx.post(url + "/v1/chat/completions", json=body, timeout=120) for url in (cluster_url, local_url)]
    assert answers[0].status_code == 200, answers[0].text
    contents = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert contents[0] == contents[1] and contents[0].lstrip().startswith("{")
    bad = {**body, "response_format": None, "structured_outputs": {"regex": "(ab"}}
    answers = [httpx.post(url + "/v1/chat/completions", json=bad, timeout=120) for url in (cluster_url, local_url)]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json()["error"]["message"] == answers[1].json()["error"]["message"]


def test_tokenize_equals_one_process(cluster_url, local_url):
    """vLLM's /tokenize, /detokenize and /version are the ingress's too (the chat template and media
    planning asked of an LLM replica): the same answers as one process."""
    import httpx

    bodies = [{"prompt": "Describe this image."},
              {"messages": [{"role": "user", "content": [part("image"), {"type": "text", "text": "Describe it."}]}],
               "return_token_strs": True}]
    for body in bodies:
        answers = [httpx.post(url + "/tokenize", json=body, timeout=120) for url in (cluster_url, local_url)]
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json() == answers[1].json()
    tokens = answers[0].json()["tokens"]
    answers = [httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=60) for url in (cluster_url, local_url)]
    assert answers[0].status_code == 200 and answers[0].json() == answers[1].json()
    assert httpx.get(cluster_url + "/version").json() == httpx.get(local_url + "/version").json()


def test_bad_media_is_the_same_client_error(cluster_url, local_url):
    """The same status, message and param as one process: a codec's or PIL's own text is left out
    of it there by the error's cause, which does not survive the pickle to the ingress (the replica
    sends the client's sentence: ReplicaFailure.of)."""
    png = (SAMPLE_MEDIA / "image_000001.png").read_bytes()
    bad = {415: "data:image/png;base64,AAAA", 400: "data:image/png;base64," + base64.b64encode(png[:200]).decode()}
    for status, url in bad.items():
        errors = []
        for url_of in (cluster_url, local_url):
            with pytest.raises(openai.APIStatusError) as err:
                ask(client(url_of, max_retries=0), [{"type": "image_url", "image_url": {"url": url}}])
            errors.append((err.value.status_code, err.value.body["message"], err.value.body["param"]))
        assert errors[0] == errors[1] and errors[0][0] == status, errors
        assert errors[0][2] == "messages.0.content.0" and errors[0][1].startswith("messages[0].content[0]: ")


def _fresh_image(k: int) -> dict:
    """An image no other test sends (nothing caches it yet), as a data-URL part."""
    from tests.support.media_samples import image_bytes

    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG", size=(61 + k, 47))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_the_calls_of_one_request_are_each_routed(cluster_url, local_url):
    """Every handle call the ingress makes for one HTTP request inherited that request's internal id,
    and Serve's request routers hand a chosen replica to the waiting call with that id: the ``n``
    choices of a request (or the encoder calls of its media items) shared it, one was routed and
    the others were routed again for good -- the request hung and stalled the ingress. Each call
    has its own id now: ``n`` = 2 answers as one process does (greedy: two equal choices), chat,
    completions and a stream, and a request of two new images has both encoded on the tier."""
    import httpx

    remote, local = client(cluster_url, max_retries=0).with_options(timeout=60), client(local_url)
    for prompt in ("hi", "Say something.", "Red square?"):
        asked = dict(model="demo-model", n=2, max_tokens=4, temperature=0)
        got, want = (c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **asked)
                     for c in (remote, local))
        assert [x.message.content for x in got.choices] == [x.message.content for x in want.choices], prompt
        got, want = (c.completions.create(prompt=prompt, **asked) for c in (remote, local))
        assert [x.text for x in got.choices] == [x.text for x in want.choices], prompt
    texts = ["", ""]
    for chunk in remote.chat.completions.create(model="demo-model", n=2, max_tokens=4, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Count."}]):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] and texts[0]
    content = [_fresh_image(1), _fresh_image(2), {"type": "text", "text": "Compare the two images."}]
    body = {"model": "demo-model", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    got = httpx.post(cluster_url + "/v1/chat/completions", json=body, timeout=60)
    want = httpx.post(local_url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    assert int(got.headers["x-encoder-cache-hits"]) >= 2  # both images came from the tier's encoders


def test_repeated_media_goes_to_one_encoder_replica(cluster_url):
    """The encoder deployment's router (consistent hashing of the content key), seen through a
    handle of the test's own: the same image thrice lands on one replica and hits from the second
    call on; the sample files use both replicas."""
    from ray import serve

    from mm_pipeline.cluster.serving.route_key import media_key

    encoders = serve.get_deployment_handle("Encoder", app_name="mmserve")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        (SAMPLE_MEDIA / "image_000002.jpg").read_bytes()).decode()}}
    reports = [encoders.encode.remote(image, media_key=media_key(image)).result(timeout_s=120) for _ in range(3)]
    assert len({r.replica for r in reports}) == 1
    assert reports[0].units > 0 and all(r.hits == r.units for r in reports[1:])
    used = set()
    for path in sorted(SAMPLE_MEDIA.glob("*_00000*.*")):
        kind = "audio" if path.name.startswith("audio") else "video" if path.name.startswith("video") else "image"
        data = base64.b64encode(path.read_bytes()).decode()
        p = ({"type": "input_audio", "input_audio": {"data": data, "format": path.suffix.lstrip(".")}} if kind == "audio"
             else {"type": f"{kind}_url", f"{kind}_url": {"url": f"data:application/octet-stream;base64,{data}"}})
        used.add(encoders.encode.remote(p, media_key=media_key(p)).result(timeout_s=120).replica)
    assert len(used) == 2


def test_conversation_and_repeated_media_stay_on_one_replica(cluster_url, request):
    c = client(cluster_url)
    history = [{"role": "system", "content": "You are a terse assistant who answers in a few words. " * 6}]
    prev_prompt = 0
    for turn in range(4):
        history.append({"role": "user", "content": f"Turn {turn}: what comes next in the sequence?"})
        r = c.chat.completions.create(model="demo-model", max_tokens=6, temperature=0, messages=history)
        if turn:  # the previous prompt's whole pages are cached: the turn went where its KV is
            assert r.usage.prompt_tokens_details.cached_tokens >= prev_prompt // 16 * 16 - 16, turn
        prev_prompt = r.usage.prompt_tokens
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    first = ask(c, [part("video"), {"type": "text", "text": "What happens in the video?"}])
    second = ask(c, [part("video"), {"type": "text", "text": "Which colours are in it?"}])
    assert int(second.headers["x-encoder-cache-hits"]) > 0
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    assert first.parse().choices[0].message.content
    if shutil.which("redis-server"):  # the router's tree is in Redis: nodes under its prefix
        import redis

        port = request.getfixturevalue("redis_server")
        assert any(True for _ in redis.Redis(port=port).scan_iter("mmserve:router:b:*", count=1000))


def test_metrics_have_a_series_per_llm_replica(cluster_url):
    """The ingress's /metrics has every LLM replica's engine counters, each labelled with its replica
    (Serve's broadcast); it used to export whichever replica answered its stats call, unlabelled, so
    the counters jumped between replicas' values."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30  # refreshed at most every second
    while True:
        text = httpx.get(cluster_url + "/metrics", timeout=10).text
        labels = [s.labels for f in text_string_to_metric_families(text) if f.name == "mmserve_generation_tokens"
                  for s in f.samples]
        if len(labels) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    replicas = {lab.get("replica") for lab in labels}
    assert len(labels) == 2 and None not in replicas and len(replicas) == 2, labels
    assert sorted(httpx.get(cluster_url + "/health", timeout=10).json()["stats"]["replicas"]) == sorted(replicas)


def test_replica_killed_under_load_loses_nothing(cluster_url, ray_local):
    ray = ray_local
    from ray import serve

    def llm_replicas() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA") and "#LLM#" in a["name"]]

    names = llm_replicas()
    assert len(names) == 2, names
    c = client(cluster_url, max_retries=3)  # a 503 after the first token is a retry for the client

    def one(i: int) -> str:
        return ask(c, f"Request {i}: count to twenty.", max_tokens=48,
                   extra_body={"ignore_eos": True}).parse().choices[0].message.content

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        # under load for sure: kill once the first answer is back (8 more are running by then)
        cf.wait(futures, timeout=120, return_when=cf.FIRST_COMPLETED)
        in_flight = sum(not f.done() for f in futures)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        done, pending = cf.wait(futures, timeout=240)
    assert in_flight > 0, "the kill came after every request had finished: it tested nothing"
    assert not pending, "requests hung after the replica died"
    assert all(f.result() is not None for f in done)  # raises if any request was lost
    deadline = time.monotonic() + 120  # Serve replaces the dead replica with a new one
    while time.monotonic() < deadline:
        now = llm_replicas()
        status = serve.status().applications["mmserve"].deployments["LLM"]
        if names[0] not in now and len(now) == 2 and status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the LLM deployment did not recover: {now} {status}")
    assert ask(c, "Still there?").parse().choices[0].message.content is not None
