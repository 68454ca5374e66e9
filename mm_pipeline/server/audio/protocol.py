"""The form fields of ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's, with
vLLM's sampling extras), validated like a JSON body: a bad value is a 400 naming the field.

Form values arrive as strings; pydantic reads "0.2" as a float and "true" / "false" as a bool.
Fields OpenAI documents that would change the answer in a way this model cannot give are refused
by name rather than ignored: ``response_format`` ``verbose_json`` / ``srt`` / ``vtt`` and
``timestamp_granularities[]`` need segment and word timestamps, which a chat model's answer does
not carry. Other unknown fields are ignored, as OpenAI-compatible servers ignore them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mm_pipeline.server.protocol import ChatCompletionRequest

TIMESTAMPED_FORMATS = ("verbose_json", "srt", "vtt")
# OpenAI's temperature and vLLM's sampling extras, passed on to the chat request (AudioForm)
PASSED_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_completion_tokens", "priority", "cache_salt")
DEFAULT_TEMPERATURE = 0.0  # OpenAI's default for transcriptions (a chat's is 1)
MAX_PROMPT_CHARS = 4096  # a form field's own cap (server/files/uploads.py) bounds it too


class AudioForm(BaseModel):
    """One transcription or translation request's own fields, its file aside. The sampling fields it
    may carry (``PASSED_FIELDS``) go to the chat request as given and are typed and bounded there,
    by the same definitions as on /v1/chat/completions (completions/sampling_fields.SamplingFields)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # ISO-639-1 ("en"), or a tag like "pt-BR": a hint in the instruction, not a decoder setting
    language: str | None = Field(default=None, pattern=r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})?$")
    # OpenAI's: earlier text of the same recording, or words and style to follow
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    response_format: Literal["json", "text"] = "json"
    stream: bool = False
    stream_include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_timestamps(cls, values: Any) -> Any:
        if isinstance(values, dict):
            if values.get("response_format") in TIMESTAMPED_FORMATS:
                raise ValueError(f"response_format {values['response_format']!r} needs timestamps, which this "
                                 f"model does not give: use json or text")
            # present at all (an empty value too: OpenAI's values are word and segment, none of which is given)
            if "timestamp_granularities[]" in values or "timestamp_granularities" in values:
                raise ValueError("timestamp_granularities needs word or segment timestamps, which this model "
                                 "does not give")
        return values


def audio_format(filename: str) -> str:
    """``input_audio.format`` from the upload's file name (the content is sniffed anyway)."""
    ext = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    return ext if ext.isalnum() and 1 <= len(ext) <= 8 else "wav"


class TranscriptionUsage(BaseModel):
    """OpenAI's token usage of a transcription (the duration form is for models billed by time)."""

    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Transcription(BaseModel):
    """The json answer of both routes."""

    text: str
    usage: TranscriptionUsage


def form_schema() -> dict[str, Any]:
    """The multipart form as JSON schema (the OpenAPI document): the file, the form's own fields and
    the sampling fields it passes on, as the chat request defines them."""
    js = AudioForm.model_json_schema()
    sampling = ChatCompletionRequest.model_json_schema()["properties"]
    js["properties"] = {"file": {"type": "string", "format": "binary", "description": "the audio (any container "
                                 "the media pipeline reads: wav, mp3, flac, ogg, m4a, webm...)"}, **js["properties"],
                        **{k: sampling[k] for k in PASSED_FIELDS}}
    js["required"] = ["file"]
    return js
