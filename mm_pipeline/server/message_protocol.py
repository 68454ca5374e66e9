"""The messages of a chat request and their content parts, as OpenAI's API spells them (with
vLLM's and this server's additions: video, audio codes, files): parsed and bounded here, read by
prompt/messages.py. The request bodies around them: protocol.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, model_validator

from llm_core.engine.sampling.params import MAX_INT32
from mm_pipeline.errors import InvalidMessageError, Where
from mm_pipeline.media.audio_codes import CODES_FORMAT, MAX_CODE_CHANNELS, AudioCodes, parse_codes
from mm_pipeline.prompt.messages import ROLES


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- chat content parts -------------------------------------------------------------------------
class TextPart(_Loose):
    type: Literal["text"]
    text: str


class URLRef(_Loose):
    url: str = Field(min_length=1)


# OpenAI's image detail, accepted as its values only: the model's processor sizes every image by
# its own pixel budget, whichever is asked (README "Serving")
ImageDetail = Literal["auto", "low", "high"]
IMAGE_DETAILS: tuple[str, ...] = get_args(ImageDetail)


class ImageURL(URLRef):
    detail: ImageDetail | None = None


class ImagePart(_Loose):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(_Loose):
    type: Literal["video_url"]
    video_url: URLRef


class AudioURLPart(_Loose):
    type: Literal["audio_url"]
    audio_url: URLRef


class InputAudio(_Loose):
    data: str = Field(min_length=1, description="base64 of the encoded audio")
    format: str = Field(min_length=1, description="wav, mp3, flac, ogg... (the content is sniffed anyway)")


class AudioPart(_Loose):
    type: Literal["input_audio"]
    input_audio: InputAudio


def _to_codes(rows: list[list[int]]) -> AudioCodes:
    # here, in the request parse (off the event loop for big bodies): the lists become 4 bytes a
    # code once, and the message dump hands the engine this object, never the lists again
    try:
        return parse_codes(rows, Where(("codes",)), ints_checked=True)  # CodeValue: strict ints
    except InvalidMessageError as exc:
        raise ValueError(str(exc).removeprefix("codes").lstrip()) from None


def _codes_out(codes: AudioCodes, info: Any) -> Any:
    return codes if info.mode == "python" else codes.codes.T.tolist()


CodeValue = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]  # strict: 1.0, "1" and true are refused
CodeLists = Annotated[list[list[CodeValue]], Field(min_length=1, max_length=MAX_CODE_CHANNELS),
                      AfterValidator(_to_codes), PlainSerializer(_codes_out)]


class InputAudioCodes(_Loose):
    codes: CodeLists = Field(description="one list of integer codes per RVQ stage, all of one length "
                                         "(codes[c][t]: stage c at frame t, 25 frames per second)")
    format: Literal["mimo_rvq"] = Field(default=CODES_FORMAT, description="the MiMo-V2.5 audio tokenizer's RVQ codes")


class AudioCodesPart(_Loose):
    """mmserve extension: pre-tokenized audio (media/audio_codes.py)."""

    type: Literal["input_audio_codes"]
    input_audio_codes: InputAudioCodes


class FileRef(_Loose):
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "FileRef":
        if (self.file_id is None) == (self.file_data is None):
            raise ValueError("a file part needs exactly one of file_id or file_data")
        return self


class FilePart(_Loose):
    type: Literal["file"]
    file: FileRef


class RefusalPart(_Loose):
    """In assistant messages (prompt/messages.py checks the role): rendered as text."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    Union[TextPart, ImagePart, VideoPart, AudioURLPart, AudioPart, AudioCodesPart, FilePart, RefusalPart],
    Field(discriminator="type")
]


class ChatMessage(_Loose):
    # the roles and what each message field means are prompt/messages.py's (parse_messages): the
    # fields it refuses (UNRENDERED: tool calls) or checks (reasoning) are declared here so that they
    # reach it instead of being dropped by this model as unknown
    role: Literal[ROLES]  # type: ignore[valid-type]
    # fail_fast: a list of a million bad parts is one error (the first), not a million
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    name: str | None = Field(default=None, description="accepted; the chat template does not render it")
    tool_call_id: str | None = Field(default=None, description="accepted; the chat template does not render it")
    refusal: str | None = Field(default=None, description="an assistant's refusal, rendered as text")
    tool_calls: list[Any] | None = Field(default=None, description="an assistant's tool calls, rendered by the "
                                                                   "chat template")
    function_call: Any = Field(default=None, description="rejected (deprecated): send tool_calls")
    reasoning_content: str | None = Field(default=None, description="an assistant's reasoning, rendered by the "
                                                                    "chat template (<think>...</think>)")
    reasoning: str | None = Field(default=None, description="vLLM's newer name for reasoning_content (the two "
                                                            "must agree when both are given)")

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self
