"""The MiMo-V2.5 reference audio path served like ours: a checkpoint in the real layout goes
through the same planner, encoder cache, cross-request batching and streamed prefill (segments are
the unit); streamed == unstreamed == a reference that encodes every segment first. Pre-tokenized
codes (input_audio_codes) give the tokens of the audio they are the codes of, by the same path."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import torch
from tests.support.audio_codes import tokenizer_codes
from tests.support.encode_first import encode_first_tokens
from tests.support.media_samples import audio_bytes

from encoders.audio.mimo_audio import MimoAudioEncoder
from llm_core import SamplingParams
from mm_pipeline.errors import ContextLengthError
from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.runtime.embedding_stream import PlaceholderSpan
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
CLIP = audio_bytes(seconds=3.0, rate=16000, channels=1, freq=300.0)  # 301 mel frames -> 4 segments of <= 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("ref") / "m", seed=5, audio_path="reference")


def make(ckpt, **kw) -> OmniEngine:
    cfg = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=8,
               max_num_batched_tokens=64)
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(**{**cfg, **kw}))


def ask(data: bytes, text: str = "Describe.") -> list[dict]:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


async def collect(engine: OmniEngine, messages):
    deltas = [d async for d in engine.generate(messages, GREEDY)]
    return [t for d in deltas for t in d.new_token_ids], deltas


def encode_first(model, prompt: list[int], rows: torch.Tensor) -> list[int]:
    """Greedy tokens of ``prompt`` (one audio item) with ``rows`` in its audio placeholders, all
    present before prefill."""
    pad = model.layout.prompt_layout.special.audio_pad
    where = [i for i, t in enumerate(prompt) if t == pad]
    assert len(where) == rows.shape[0] == where[-1] - where[0] + 1
    span = PlaceholderSpan(where[0], where[-1] + 1, "a")
    return encode_first_tokens(model.text, prompt, [span], [rows], model.hidden_size, GREEDY)


def test_reference_audio_is_served_cached_and_streamed(ckpt):
    streamed, unstreamed = make(ckpt), make(ckpt, stream_embeddings=False)
    try:
        model = streamed.runtime.model
        assert isinstance(model.audio, MimoAudioEncoder)
        tokens, deltas = asyncio.run(collect(streamed, ask(CLIP)))
        prompt = deltas[0].prompt_token_ids
        s = streamed.stats()
        assert s.encoder["encoded.audio"] == 4 and len(tokens) == GREEDY.max_tokens

        # reference: decode, cut into segments, encode each one alone, then prefill with all rows
        audio = decode_audio(MediaItem(MediaKind.AUDIO, "wav", CLIP), model.audio_config.sampling_rate)
        segments = streamed.runtime.pre.audio_segments(audio)
        rows = torch.cat([model.audio.encode_segments([seg])[0] for seg in segments])
        assert tokens == encode_first(model, prompt, rows)

        got, _ = asyncio.run(collect(unstreamed, ask(CLIP)))
        assert got == tokens

        # a new question about the same clip: every segment from the cache, nothing decoded again
        again, deltas = asyncio.run(collect(streamed, ask(CLIP, "Again?")))
        after = streamed.stats()
        assert deltas[0].encoder_cache_hits == 4
        assert after.encoder["encoded.audio"] == 4 and after.media["audio_decoded"] == 1
    finally:
        streamed.shutdown()
        unstreamed.shutdown()


def test_segments_of_concurrent_requests_share_forwards(ckpt):
    engine = make(ckpt, encoder_max_wait_ms=200.0)
    try:
        clips = [audio_bytes(seconds=1.5, rate=16000, channels=1, freq=200.0 + 50 * i) for i in range(3)]

        async def all_three():
            return await asyncio.gather(*(collect(engine, ask(c)) for c in clips))

        results = asyncio.run(all_three())
        s = engine.stats()
        assert all(len(t) == GREEDY.max_tokens for t, _ in results)
        assert s.encoder["encoded.audio"] == 3 * 2  # 151 mel frames each -> 2 segments
        assert s.encoder["forwards.audio"] < 6  # batched across requests
    finally:
        engine.shutdown()


# ---- pre-tokenized audio codes (issue 23): the audio's own segments, through the same machinery --
def codes_of(engine: OmniEngine, data: bytes) -> torch.Tensor:
    return tokenizer_codes(engine.runtime, data)


def ask_codes(codes, text: str = "Describe.") -> list[dict]:
    part = {"type": "input_audio_codes", "input_audio_codes": {"codes": codes, "format": "mimo_rvq"}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def test_codes_give_the_tokens_of_their_audio_streamed_unstreamed_and_cached(ckpt):
    streamed, unstreamed = make(ckpt), make(ckpt, stream_embeddings=False)
    try:
        codes = codes_of(streamed, CLIP)
        assert codes.shape[1] == 3 * 24 + 4  # 3 whole segments of 96 mel frames (24 code frames) + 13 frames
        audio_tokens, audio_deltas = asyncio.run(collect(streamed, ask(CLIP)))
        tokens, deltas = asyncio.run(collect(streamed, ask_codes(codes.tolist())))
        assert deltas[0].prompt_token_ids == audio_deltas[0].prompt_token_ids
        assert tokens == audio_tokens
        s = streamed.stats()
        assert s.encoder["encoded.audio"] == 4 + 4 and s.media["audio_codes"] == 1
        assert s.media["audio_decoded"] == 1  # the codes decoded nothing

        # the encode-first reference over the codes' own rows
        model = streamed.runtime.model
        rows = torch.cat([model.audio.encode_codes(seg.T) for seg in torch.split(codes, 24, dim=1)])
        assert tokens == encode_first(model, deltas[0].prompt_token_ids, rows)

        assert asyncio.run(collect(unstreamed, ask_codes(codes.tolist())))[0] == tokens

        # the same codes again (as a tensor this time): every segment from the encoder cache
        again, deltas = asyncio.run(collect(streamed, ask_codes(codes, "Again?")))
        assert deltas[0].encoder_cache_hits == 4 and streamed.stats().encoder["encoded.audio"] == 8

        # units evicted, the manifest kept: planned from the manifest, the segments made again from
        # the codes' bytes (the path of a restart with a disk cache), the same answer
        memory = streamed.runtime.cache.tiers[0]
        for key in memory.keys():
            if not key.startswith("enc:manifest:"):
                memory.delete(key)
        before = streamed.stats().media.get("manifest_hits.audio", 0)
        assert asyncio.run(collect(streamed, ask_codes(codes)))[0] == tokens
        s = streamed.stats()
        assert s.media["manifest_hits.audio"] == before + 1 and s.encoder["encoded.audio"] == 8 + 4
    finally:
        streamed.shutdown()
        unstreamed.shutdown()


def test_codes_and_decoded_audio_share_encoder_batches(ckpt):
    # one encoder lane: with two, each lane takes half the queue (test_encoder_worker.py's lanes test)
    engine = make(ckpt, encoder_max_wait_ms=1000.0, encoder_lanes=1)
    try:
        other = audio_bytes(seconds=1.5, rate=16000, channels=1, freq=420.0)
        codes = codes_of(engine, CLIP).tolist()
        audio = engine.runtime.model.audio
        mixed, inner = [], audio.encode_segments_and_codes
        audio.encode_segments_and_codes = lambda m, c: mixed.append((len(m), len(c))) or inner(m, c)

        async def both():
            return await asyncio.gather(collect(engine, ask(other)), collect(engine, ask_codes(codes)))

        (_, _), (tokens, _) = asyncio.run(both())
        s = engine.stats()
        assert s.encoder["encoded.audio"] == 2 + 4
        assert (2, 4) in mixed  # both requests' segments in one batch: one tokenizer + one speech forward
        alone = make(ckpt)
        try:
            assert asyncio.run(collect(alone, ask_codes(codes)))[0] == tokens
        finally:
            alone.shutdown()
    finally:
        engine.shutdown()


def test_multimodal_llm_takes_codes_as_a_tensor(ckpt):
    from mm_pipeline.multimodal_llm import MultimodalLLM

    llm = MultimodalLLM.from_engine(make(ckpt))
    try:
        codes = codes_of(llm.engine, CLIP)
        audio, as_tensor, as_lists, wrong = llm.chat([ask(CLIP), ask_codes(codes.numpy()), ask_codes(codes.tolist()),
                                                      ask_codes(codes[:3])], GREEDY)
        assert as_tensor.token_ids == audio.token_ids == as_lists.token_ids
        assert wrong.finish_reason == "error" and "3 channels" in wrong.error and "4 RVQ stages" in wrong.error
    finally:
        llm.close()


def test_codes_over_the_context_are_refused_before_anything_is_encoded(ckpt):
    engine = make(ckpt, max_model_len=160)
    try:
        codes = codes_of(engine, CLIP)  # 19 audio tokens, a 126-token prompt ...
        long = torch.cat([codes] * 4, dim=1)  # ... 4 times: 76 audio tokens, over the 160-token context
        with pytest.raises(ContextLengthError, match="context limit of 160"):
            asyncio.run(collect(engine, ask_codes(long)))
        assert engine.stats().encoder.get("encoded.audio", 0) == 0
        assert len(asyncio.run(collect(engine, ask_codes(codes)))[0]) == GREEDY.max_tokens
    finally:
        engine.shutdown()
