"""KV reuse a user gets with no flags: ``mmserve serve --model samples/demo-model`` in a child process,
asked over HTTP (issue 15). Same request twice, a new question about the same video / image / audio, a
six-turn conversation; greedy answers equal to a server started with ``--no-enable-prefix-caching``;
the pool split and the resident memory at start.

Only whole pages are cached (docs/kv_cache.md §2), so "up to position N" means up to N's page:
``page_floor(n) = n // 16 * 16`` on the demo model's 16-token pages.
"""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from llm_core.engine.engine_config import EngineConfig
from llm_core.kvcache.dual_pool import KVLayout, swa_tokens_needed
from llm_core.model.config import ModelConfig
from mm_pipeline.server.launch.server_process import ServerProcess
from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")

PAGE = EngineConfig().page_size
MEDIA = {"video": "video_000000.mp4", "image": "image_000001.png", "audio": "audio_000003.wav"}
# what the chat template puts after the last user content part (samples/demo-model/chat_template.jinja)
AFTER_CONTENT = "<|im_end|>\n<|im_start|>assistant\n"


def page_floor(n: int) -> int:
    return n // PAGE * PAGE


@pytest.fixture(scope="module")
def default_server():
    with ServerProcess(["--model", str(DEMO_MODEL), "--device", "cpu"]) as server:
        server.rss_at_start = server.rss_bytes()
        yield server


@pytest.fixture(scope="module")
def cache_off_server():
    with ServerProcess(["--model", str(DEMO_MODEL), "--device", "cpu", "--no-enable-prefix-caching"]) as server:
        yield server


def media_part(kind: str) -> dict:
    data = base64.b64encode((SAMPLE_MEDIA / MEDIA[kind]).read_bytes()).decode()
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return {"type": f"{kind}_url", f"{kind}_url": {"url": f"data:application/octet-stream;base64,{data}"}}


def chat(server, messages: list[dict], max_tokens: int = 12) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                   json={"model": "demo-model", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def media_question(kind: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [media_part(kind), {"type": "text", "text": question}]}]


def media_end(answer: dict, question: str) -> int:
    """Prompt position right after the media item: the prompt minus the tokens after it."""
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    return answer["usage"]["prompt_tokens"] - len(tok.encode(question + AFTER_CONTENT, add_special_tokens=False).ids)


def test_the_same_request_twice_reuses_at_least_90_percent(default_server):
    """All but the prompt's last partial page is reused (a match leaves one token to compute); with a
    system prompt every prompt here is at least 10 pages, so that is at least 90 %."""
    system = {"role": "system", "content": "You describe media for a catalogue, briefly and in plain words. " * 4}
    for messages in [*([system, *media_question(k, "Describe this.")] for k in MEDIA),
                     [system, {"role": "user", "content": "A question that is only text, asked twice in a row."}]]:
        first, again = chat(default_server, messages), chat(default_server, messages)
        prompt = again["usage"]["prompt_tokens"]
        assert prompt >= 10 * PAGE
        assert cached(again) == page_floor(prompt - 1) >= 0.9 * prompt, again["usage"]
        assert again["choices"][0]["message"] == first["choices"][0]["message"]


@pytest.mark.parametrize("kind", list(MEDIA))
def test_a_new_question_about_the_same_media_reuses_it(default_server, kind):
    chat(default_server, media_question(kind, f"Describe this {kind}."))
    question = f"What colour is it, and what comes next in this {kind}?"
    answer = chat(default_server, media_question(kind, question))
    end = media_end(answer, question)
    assert end > 2 * PAGE  # the media region is most of the prompt
    assert page_floor(end) <= cached(answer) < answer["usage"]["prompt_tokens"], answer["usage"]


def test_each_turn_of_a_conversation_reuses_the_previous_turn(default_server):
    """Six turns, each longer than the sliding window (31 tokens), so the window is crossed several
    times per turn. A turn's prompt is the previous prompt, the reply and the new message; the
    template renders a past reply as ``<think></think>reply``, which the model did not generate
    after the previous prompt, so what two turns share ends with the previous prompt."""
    messages = [{"role": "system", "content": "You answer questions about shapes and colours. " * 3}]
    previous = None
    for turn in range(6):
        messages.append({"role": "user", "content": f"Turn {turn}: which shape comes after shape {turn}, and in "
                                                    f"what colour is it drawn? Say it in a few words."})
        answer = chat(default_server, messages, max_tokens=16)
        if previous is not None:
            # the previous prompt is kept up to its last whole page (a match leaves one token to compute)
            assert cached(answer) >= page_floor(previous["usage"]["prompt_tokens"] - 1), (turn, answer["usage"])
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        previous = answer


def test_greedy_answers_equal_a_server_without_prefix_caching(default_server, cache_off_server):
    asks = [media_question("video", "Describe this video."), media_question("video", "And what happens next?"),
            media_question("image", "Describe this image."), media_question("audio", "What do you hear?"),
            [{"role": "user", "content": "Describe a red triangle."}]]
    for messages in asks + asks:  # the second round runs on a warm cache
        on, off = chat(default_server, messages, max_tokens=16), chat(cache_off_server, messages, max_tokens=16)
        assert on["choices"][0]["message"] == off["choices"][0]["message"]
        assert cached(off) == 0
    assert cached(on) > 0


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_default_pool_split_is_the_formula_and_the_server_starts_small(default_server):
    """SWA gets what 64 running requests and the checkpoint reserve need (not a copy of Full), Full
    what 64 requests of the model's context can use; start-up prints it and the RSS stays small."""
    cfg, model = EngineConfig(), ModelConfig.from_pretrained(DEMO_MODEL)
    layout = KVLayout.from_model_config(model)
    swa_tokens = swa_tokens_needed(layout, page_size=PAGE, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   swa_release_interval=cfg.swa_release_interval,
                                   checkpoint_reserve_windows=cfg.swa_checkpoint_reserve_windows)
    full_tokens = cfg.max_num_seqs * model.max_position_embeddings
    # speculative decoding is on by default for the demo's MTP head: its one drafting layer keeps
    # sliding-window KV in the SWA pool too (docs/speculative.md)
    mtp = 1 if (DEMO_MODEL / "model-mtp.safetensors").is_file() else 0
    served = KVLayout(layout.layer_kinds + ("sliding",) * mtp, layout.full, layout.sliding, layout.window)
    swa_bytes, full_bytes = swa_tokens * served.swa_bytes_per_token(torch.float32), \
        full_tokens * layout.full_bytes_per_token(torch.float32)
    assert metric(default_server, "mmserve_kv_pool_total_tokens", pool="swa") == swa_tokens
    assert metric(default_server, "mmserve_kv_pool_total_bytes", pool="swa") == swa_bytes
    assert metric(default_server, "mmserve_kv_pool_total_bytes", pool="full") == full_bytes
    assert swa_tokens * layout.swa_bytes_per_token(torch.float32) <= full_bytes / 4  # the main model's layers
    assert metric(default_server, "mmserve_max_context_tokens") == model.max_position_embeddings
    startup = default_server.output
    assert f"SWA {swa_tokens:,} tokens" in startup and f"Full {full_tokens:,} tokens" in startup
    assert default_server.rss_at_start < 3 << 30, default_server.rss_at_start


def test_the_default_server_logs_the_engine_line_while_it_works(default_server):
    """vLLM's periodic stats line, on by default (--log-stats-interval-s 10) and shown without -v; the
    token counters behind it are on /metrics."""
    deadline = time.monotonic() + 30
    while "mmserve.stats:" not in default_server.output:
        assert time.monotonic() < deadline, default_server.output[-2000:]
        chat(default_server, [{"role": "user", "content": "Count to twenty."}], max_tokens=64)  # keep it busy
        time.sleep(0.5)
    line = next(ln for ln in default_server.output.splitlines() if "mmserve.stats:" in ln)
    assert "tokens/s" in line and "running" in line and "KV full" in line
    assert metric(default_server, "mmserve_generation_tokens_total") > 0
    assert metric(default_server, "mmserve_prompt_tokens_total") > 0
