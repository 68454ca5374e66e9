"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: OpenAI's audio API (what
``client.audio.transcriptions.create(file=..., model=...)`` sends), answered by the omni model as a
chat about the audio.

    multipart/form-data: file (required), model, language, prompt, response_format (json | text),
                         stream, stream_include_usage                      (protocol.py), and as on
                         /v1/chat/completions: temperature (default 0 here), top_p, top_k, seed,
                         max_completion_tokens, priority, cache_salt
    -> json:   {"text": "...", "usage": {"type": "tokens", "input_tokens", "output_tokens", "total_tokens"}}
       text:   the transcript as text/plain
       stream: SSE "transcription.chunk" events, vLLM's shape: {"choices": [{"delta": {"content": ...},
               "finish_reason", "stop_reason"}]}, with stream_include_usage a last one of usage, then [DONE]

The file is read into memory under ``max_audio_upload_bytes`` (25 MiB by default, OpenAI's limit;
``--max-audio-upload-bytes``), then becomes one user message: an ``input_audio`` part and the
instruction (``--transcription-prompt`` / ``--translation-prompt``, then the request's language and
prompt). From there it is a chat request like any other (ChatService): the same admission, limits,
decoding (any container or codec the media pipeline reads; the content is sniffed, the file name
only names the format), encoder and prefix caches, errors and disconnect handling. The answer is
the message's content; a reasoning model's thinking is left out.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pybase64
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from mm_pipeline.errors import MMServeError
from mm_pipeline.server.completions.answer_info import AnswerInfo
from mm_pipeline.server.audio.protocol import (DEFAULT_TEMPERATURE, PASSED_FIELDS, AudioForm, Transcription,
                                              TranscriptionUsage, audio_format)
from mm_pipeline.server.completions.chat_service import ChatService
from mm_pipeline.server.files.uploads import FormUpload, receive_form
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.request_id import name_failed_answer
from mm_pipeline.server.responses import ChatCompletionChunk
from mm_pipeline.server.settings import ServerSettings
from mm_pipeline.server.sse import DONE, SSE_HEADERS, ClientDisconnected, error_event, sse_event, until_disconnected

_OFF_LOOP_BYTES = 1 << 20  # base64 of a bigger file is written on a thread (the loop keeps serving)


def install_audio_routes(app: FastAPI, service: ChatService, settings: ServerSettings) -> None:
    """Add the two routes; ``service`` answers the chat each request becomes."""

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _answer(request, service, settings, translate=False)

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _answer(request, service, settings, translate=True)


def instruction(settings: ServerSettings, form: AudioForm, translate: bool) -> str:
    """What the model is asked with the audio: the server's prompt, the language hint (a
    transcription's: a translation's target is English), the request's own prompt."""
    text = settings.translation_prompt if translate else settings.transcription_prompt
    if form.language and not translate:
        text += f" The speech is in {form.language}."
    if form.prompt:
        text += f" Earlier text or words to expect: {form.prompt}"
    return text


async def chat_request(upload: FormUpload, form: AudioForm, text: str) -> ChatCompletionRequest:
    """The chat a transcription or translation is answered as."""
    if len(upload.data) > _OFF_LOOP_BYTES:
        data = await asyncio.to_thread(pybase64.b64encode_as_string, upload.data)
    else:
        data = pybase64.b64encode_as_string(upload.data)
    body: dict[str, Any] = {
        "model": form.model,
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": data, "format": audio_format(upload.filename)}},
            {"type": "text", "text": text}]}],
        "temperature": DEFAULT_TEMPERATURE, **{k: upload.fields[k] for k in PASSED_FIELDS if k in upload.fields},
        "stream": form.stream}
    if form.stream:
        body["stream_options"] = {"include_usage": form.stream_include_usage}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def _answer(request: Request, service: ChatService, settings: ServerSettings, translate: bool) -> Response:
    what = "translation request" if translate else "transcription request"
    upload = await receive_form(request, settings.max_audio_upload_bytes, what, settings.request_body_idle_s)
    try:
        form = AudioForm.model_validate(upload.fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    service.check_model(form.model)
    chat = await chat_request(upload, form, instruction(settings, form, translate))
    del upload  # the bytes live on as the message's base64 until the media pipeline reads them
    info = AnswerInfo()
    try:
        if not form.stream:
            result = await until_disconnected(request, service.chat(chat, info))
            text = (result.choices[0].message.content or "") if result.choices else ""
            if form.response_format == "text":
                return PlainTextResponse(text, headers=info.headers())
            u = result.usage
            usage = TranscriptionUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                                       total_tokens=u.total_tokens)
            return JSONResponse(Transcription(text=text, usage=usage).model_dump(), headers=info.headers())
        chunks, close = await until_disconnected(request, service.chat_chunks(chat, info))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        name_failed_answer(request, info.request_id)  # set once the answer began (None: refused at its start)
        if isinstance(exc, MMServeError):
            raise _named_by_form(exc) from exc.__cause__
        raise
    return StreamingResponse(_events(chunks, request.url.path, info.request_id), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **info.headers()}, background=BackgroundTask(close))


async def _events(chunks: AsyncIterator[ChatCompletionChunk], route: str, request_id: str | None
                  ) -> AsyncIterator[str]:
    """The chat's chunks as vLLM's transcription chunks: text deltas and the end, then usage; an
    error's log line names ``route`` and ``request_id``."""
    try:
        async for c in chunks:
            head = {"id": c.id, "object": "transcription.chunk", "created": c.created, "model": c.model}
            if not c.choices:  # the usage chunk (stream_include_usage)
                if c.usage is not None:
                    yield sse_event({**head, "choices": [], "usage": c.usage.model_dump()})
                continue
            choice = c.choices[0]
            content = choice.delta.content
            if content or choice.finish_reason is not None:
                yield sse_event({**head, "choices": [{"delta": {"content": content or ""},
                                                      "finish_reason": choice.finish_reason, "stop_reason": None}]})
    except Exception as exc:
        yield error_event(_named_by_form(exc) if isinstance(exc, MMServeError) else exc, route, request_id)
    yield DONE


def _named_by_form(exc: MMServeError) -> MMServeError:
    """An error about the audio part of the chat a form is answered as (``messages[0].content[0]:
    ...``), named as the client sent it: the form's ``file`` field."""
    if exc.loc[:4] != ("messages", 0, "content", 0):
        return exc
    return exc.located("file" + str(exc).removeprefix(str(exc.loc)), ("file",))
