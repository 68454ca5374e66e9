"""Offline API: MultimodalLLM.chat over local files of every modality, per-conversation errors,
plain generate == llm_core.LLM.generate on the same checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from llm_core import LLM, RequestOutput, SamplingParams
from tests.support.media_samples import audio_bytes, image_bytes, video_bytes
from mm_pipeline.errors import InvalidMessageError
from mm_pipeline.multimodal_llm import MultimodalLLM
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("media")
    files = {"image": ("cat.png", image_bytes(size=(70, 50))), "video": ("clip.mp4", video_bytes(n_frames=40)),
             "audio": ("tone.wav", audio_bytes(seconds=1.5)), "broken": ("bad.jpg", b"\xff\xd8\xff\xe0broken")}
    out = {}
    for key, (name, data) in files.items():
        (d / name).write_bytes(data)
        out[key] = d / name
    return out


@pytest.fixture(scope="module")
def llm(ckpt):
    with MultimodalLLM(ckpt, **ENGINE) as m:
        yield m


def convo(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]


def test_chat_every_modality_from_local_paths(llm, media):
    outs = llm.chat([
        convo({"type": "image_url", "image_url": {"url": str(media["image"])}}),
        convo({"type": "video_url", "video_url": {"url": media["video"].as_uri()}}),
        convo({"type": "audio", "audio": str(media["audio"])}),
        convo({"type": "image", "image": media["image"].read_bytes()},
              {"type": "audio_url", "audio_url": {"url": str(media["audio"])}}),
    ], GREEDY)
    assert len(outs) == 4
    for out in outs:
        assert isinstance(out, RequestOutput)
        assert out.finished and out.finish_reason == "length", out.error
        assert len(out.token_ids) == GREEDY.max_tokens and out.prompt_token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # identical image, same question, given as path or as bytes -> same prompt and answer
    again = llm.chat(convo({"type": "image", "image": media["image"].read_bytes()}), GREEDY)[0]
    assert again.token_ids == outs[0].token_ids and again.prompt_token_ids == outs[0].prompt_token_ids
    assert llm.engine.stats().media["images_decoded"] == 1  # the repeat came from the cache


def test_broken_file_fails_only_its_conversation(llm, media):
    outs = llm.chat([convo({"type": "image_url", "image_url": {"url": str(media["broken"])}}),
                     convo({"type": "image_url", "image_url": {"url": str(media["image"])}}),
                     convo({"type": "image_url", "image_url": {"url": str(media["image"]) + ".missing"}})], GREEDY)
    assert outs[0].finish_reason == "error" and outs[0].error_kind == "media"
    assert "messages[0].content[0]: image from file cannot be read" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].error_kind is None
    assert outs[2].finish_reason == "error" and "no such media file" in outs[2].error
    assert outs[2].error_kind == "media"
    with pytest.raises(InvalidMessageError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}], GREEDY)


def test_generate_matches_text_only_llm(llm, ckpt):
    prompts = ["Hello there", [5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 12]]
    ours = llm.generate(prompts, GREEDY)
    ref = LLM(ckpt, **ENGINE).generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    assert [o.prompt_token_ids for o in ours] == [r.prompt_token_ids for r in ref]
    # LLM.generate's prompt forms: a 1-D tensor is one token-id prompt
    assert [o.token_ids for o in llm.generate(torch.tensor(prompts[1]), GREEDY)] == [ours[1].token_ids]
    with pytest.raises(TypeError, match="prompt 0 must be a string or token ids"):
        llm.generate([None], GREEDY)


def test_chat_takes_vllms_template_arguments(llm, media):
    """``chat(..., chat_template_kwargs=, add_generation_prompt=, continue_final_message=)`` as vLLM's
    LLM.chat: the prompt is what transformers' apply_chat_template makes of them; a kwarg the
    template does not read fails its conversation, naming it, before the media is read."""
    text = [{"role": "user", "content": "Describe."}]
    cont = [*text, {"role": "assistant", "content": "It is"}]
    cases = [(text, dict(chat_template_kwargs={"enable_thinking": False})),
             (text, dict(add_generation_prompt=False)),
             (cont, dict(add_generation_prompt=False, continue_final_message=True))]
    for messages, kw in cases:
        out = llm.chat(messages, GREEDY, **kw)[0]
        assert out.finish_reason == "length", out.error
        ref = llm.tokenizer.apply_chat_template(  # transformers' add_generation_prompt defaults to false
            messages, tokenize=True, return_dict=False, add_generation_prompt=kw.get("add_generation_prompt", True),
            continue_final_message=kw.get("continue_final_message", False), **kw.get("chat_template_kwargs", {}))
        assert out.prompt_token_ids == ref, kw
    decodes = llm.engine.stats().media.get("images_decoded", 0)  # absent until an image was decoded
    bad = llm.chat(convo({"type": "image_url", "image_url": {"url": str(media["image"]) + ".other"}}), GREEDY,
                   chat_template_kwargs={"thinking_budget": 5})[0]
    assert bad.finish_reason == "error" and "chat_template_kwargs.thinking_budget is not read" in bad.error
    assert llm.engine.stats().media.get("images_decoded", 0) == decodes
    with pytest.raises(InvalidMessageError, match="cannot both be true"):
        llm.chat(cont, GREEDY, continue_final_message=True)


def test_priority_and_cache_salt_are_checked_for_the_whole_call(llm):
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="priority scheduling is off"):
        llm.chat([convo({"type": "text", "text": "hi"})], greedy, priority=[3])
    with pytest.raises(ValueError, match="1 priorities for 2 inputs"):
        llm.generate([[5, 6], [7, 8]], greedy, priority=[0])
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([[5, 6]], greedy, cache_salt="")
    salted = llm.generate([[5, 6, 7, 8, 9]], greedy, priority=[0], cache_salt="tenant-a")
    assert salted[0].finish_reason in ("length", "stop") and salted[0].error is None


def test_a_call_takes_more_inputs_than_max_queue(ckpt):
    """More inputs than the engine admits at once (max_queue) all run, the rest as earlier ones
    finish: the same answers as one by one, and the engine idle after."""
    prompts = [[5 + i, 17, 99, 3 * i + 1, 250] for i in range(7)]
    with MultimodalLLM(ckpt, max_queue=2, **ENGINE) as small:
        alone = [small.generate([p], GREEDY)[0].token_ids for p in prompts]
        outs = small.generate(prompts, GREEDY)
        assert [o.finish_reason for o in outs] == ["length"] * 7, [o.error for o in outs]
        assert [o.token_ids for o in outs] == alone
        chats = small.chat([convo({"type": "text", "text": f"hi {i}"}) for i in range(5)], GREEDY)
        assert [o.finish_reason for o in chats] == ["length"] * 5, [o.error for o in chats]
        assert small.engine.requests_in_flight == 0


def test_a_call_that_raises_leaves_the_engine_idle(llm):
    """A job that raises fails the call; its siblings are ended, not left running unseen."""
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with pytest.raises(TypeError, match="params must be llm_core.SamplingParams"):
        llm.generate([[5, 6, 7]] * 4 + [[8, 9]], [long] * 4 + ["not params"])
    assert llm.engine.requests_in_flight == 0
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"


def test_a_call_after_close_raises(ckpt):
    m = MultimodalLLM(ckpt, **ENGINE)
    m.close()
    m.close()  # idempotent
    result: dict[str, BaseException | None] = {}

    def call() -> None:
        try:
            m.generate([[5, 6]], GREEDY)
            result["raised"] = None
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            result["raised"] = exc

    worker = threading.Thread(target=call, daemon=True)  # a regression hangs: fail, do not hang the run
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a call after close() hangs"
    assert isinstance(result["raised"], RuntimeError) and "MultimodalLLM is closed" in str(result["raised"])


def _record_admissions(m: MultimodalLLM, hold: str | None = None) -> tuple[list[str], threading.Event]:
    """Request ids in the order they got one of ``m``'s slots (entered the engine); the request
    ``hold`` keeps its slot, before any work, until the returned event is set."""
    admitted: list[str] = []
    release = threading.Event()
    real = m.engine.outputs

    async def recording(params, **kw):
        admitted.append(kw["request_id"])
        while kw["request_id"] == hold and not release.is_set():
            await asyncio.sleep(0.005)
        async with aclosing(real(params, **kw)) as outs:
            async for out in outs:
                yield out

    m.engine.outputs = recording
    return admitted, release


def _loop_tasks(m: MultimodalLLM, coro_name: str) -> int:
    """Tasks of ``m``'s event loop running ``coro_name``, once every task already scheduled has run
    its first step (a round trip through the loop after them)."""
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), m._loop).result(10)
    return sum(t.get_coro().__qualname__.endswith(coro_name) for t in asyncio.all_tasks(m._loop))


def test_waiting_inputs_get_slots_by_priority(ckpt):
    """More inputs than slots (max_queue 1) under the priority policy: a freed slot goes to the most
    urgent waiting input (lower first, arrival order among equals), within a call and across calls;
    FIFO without priorities. (The slots were a FIFO semaphore: priorities were ignored there.)"""
    prompts = [[5 + i, 17, 99, 3 * i + 1, 250] for i in range(6)]
    with MultimodalLLM(ckpt, max_queue=1, queue_policy="priority", **ENGINE) as m:
        admitted, _ = _record_admissions(m)
        outs = m.generate(prompts, GREEDY, priority=[5, 5, 0, 3, 0, 9])
        assert [o.finish_reason for o in outs] == ["length"] * 6  # in input order, as always
        assert [int(r.split("-")[1]) for r in admitted] == [2, 4, 3, 0, 1, 5]
        admitted.clear()
        m.generate(prompts[:4], GREEDY)  # no priorities: FIFO
        assert [int(r.split("-")[1]) for r in admitted] == [6, 7, 8, 9]

        # an urgent call that comes while a less urgent one's inputs wait goes before them
        admitted, release = _record_admissions(m, hold="mmllm-10")
        first = threading.Thread(target=m.generate, args=(prompts[:4], GREEDY), kwargs={"priority": [5] * 4},
                                 daemon=True)
        first.start()
        deadline = time.monotonic() + 30
        while _loop_tasks(m, "_one") < 4 and time.monotonic() < deadline:  # mmllm-10 holds the slot, 11-13 wait
            time.sleep(0.01)
        urgent = threading.Thread(target=m.generate, args=(prompts[4:5], GREEDY), kwargs={"priority": [0]},
                                  daemon=True)
        urgent.start()
        while _loop_tasks(m, "_one") < 5 and time.monotonic() < deadline:  # mmllm-14 waits too
            time.sleep(0.01)
        release.set()
        first.join(60)
        urgent.join(60)
        assert not first.is_alive() and not urgent.is_alive()
        assert admitted == ["mmllm-10", "mmllm-14", "mmllm-11", "mmllm-12", "mmllm-13"]
        assert m.engine.requests_in_flight == 0


def test_close_from_another_thread_ends_the_running_call(ckpt):
    """close() while a call runs in another thread: the call raises RuntimeError promptly (no
    output of an unfinished input comes back as if complete), close() returns with the engine shut
    down and every thread it started gone; a second close() does nothing. (The call hung for good:
    close() stopped the loop its jobs ran on.)"""
    before = set(threading.enumerate())
    m = MultimodalLLM(ckpt, max_queue=2, **ENGINE)
    admitted, _ = _record_admissions(m)
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    result: dict[str, object] = {}

    def call() -> None:
        try:
            result["outs"] = m.generate([[5 + i, 17, 99] for i in range(8)], long)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            result["raised"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while len(admitted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(admitted) == 2, "the call did not start"
    t0 = time.monotonic()
    m.close()
    assert time.monotonic() - t0 < 20
    caller.join(10)
    assert not caller.is_alive(), "the running call hangs after close()"
    assert "outs" not in result
    assert isinstance(result["raised"], RuntimeError) and "closed while this call was running" in str(result["raised"])
    assert m.engine.requests_in_flight == 0
    deadline = time.monotonic() + 10
    while (left := [t.name for t in set(threading.enumerate()) - before - {caller} if t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left running after close(): {left}"
    m.close()  # a no-op
    with pytest.raises(RuntimeError, match="MultimodalLLM is closed"):
        m.generate([[5, 6]], GREEDY)
