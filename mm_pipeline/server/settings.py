"""Server settings (everything the HTTP layer decides; media and engine limits live in the engine's
own config)."""

from __future__ import annotations

from dataclasses import dataclass

from mm_pipeline.prompt.reasoning import REASONING_PARSERS, ReasoningParserName
from mm_pipeline.prompt.tool_calls import TOOL_PARSERS, ToolParserName
from mm_pipeline.server.json_limits import JSONLimits
from mm_pipeline.server.request_body import BODY_IDLE_S


@dataclass(frozen=True)
class ServerSettings:
    """``files_dir``: where uploads are kept (None: a temporary directory removed at shutdown).
    ``api_key``: when set, every route but ``/health`` and the upload page (``/``, ``/web/*``) needs
    ``Authorization: Bearer <api_key>``: ``/v1``, ``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``,
    ``/openapi.json``, ``/docs``, ``/redoc``."""

    model_name: str | None = None  # default: the engine's model_name
    # other names requests may give the model (--served-model-name's later ones): answers and
    # /v1/models name the first, model_name
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    files_dir: str | None = None
    max_upload_bytes: int = 512 << 20
    max_files_total_bytes: int = 8 << 30
    """Bytes all uploads may hold together (every upload counts, duplicates of stored bytes too)."""
    max_files: int = 10_000
    """File ids the upload store keeps at once."""
    default_max_tokens: int | None = None
    """max_tokens of a request without one; none: the model's max_new_tokens (generation_config.json), else 512."""
    max_request_bytes: int = 256 << 20
    """Largest JSON request body (base64 media inline counts); a larger one is 413. Also the
    longest line of a /v1/batches file (each line is a request): a longer one fails the batch."""
    max_json_values: int = 4_000_000
    """Values (array items, object members) one JSON body, or batch file line, may hold; more is 413."""
    # It bounds the parser's memory (request_body._validate): an hour of pre-tokenized audio codes is
    # 20 x 90,000 = 1.8M values.
    request_body_idle_s: float = BODY_IDLE_S
    """Longest wait for the next piece of a request body (JSON or upload): past it, 408 and the connection closed."""
    # uvicorn has no body timeout: a client that declared a length and went quiet held its
    # connection and handler for good (request_body.body_chunks)
    max_json_objects: int = 65_536
    """JSON objects (messages, content parts, tool calls, ...) one body, or batch file line, may hold; more is 413."""
    # Each becomes a model of several Python objects, built with the GIL held and walked by every
    # full garbage collection with all threads stopped: at the default the event loop's longest
    # stall stays near 50 ms (json_limits.py, benchmarks/body_validation.py).
    max_completion_prompts: int = 16
    """Prompts one /v1/completions request may list."""
    # Each prompt is admitted as its own engine request (times n), so a long list would take every
    # admission slot at once; 16 x n <= 16 fits max_queue's 256.
    reasoning_parser: ReasoningParserName = "auto"
    """Chat answers' <think>...</think> go to message.reasoning_content (qwen3 semantics); auto: when
    the model's vocabulary has both tags as tokens."""
    # auto, not off, by default: a MiMo user expects the thinking apart from the answer, as SGLang
    # and vLLM serve MiMo-V2-Flash with --reasoning-parser qwen3; a model without the tag tokens
    # is left alone. create_app resolves it against the model's tokenizer (reasoning.py).
    tool_call_parser: ToolParserName = "auto"
    """Chat answers' <tool_call> blocks go to message.tool_calls (vLLM's qwen3_coder, MiMo's format);
    auto: when the model's vocabulary or chat template knows <tool_call>; none: requests with tools are
    refused."""

    max_audio_upload_bytes: int = 25 << 20
    """Largest audio file /v1/audio/transcriptions and /translations take (held in memory while it is
    answered; OpenAI's own limit is 25 MB); more is 413."""
    transcription_prompt: str = "Transcribe the speech in this audio word for word."
    """What /v1/audio/transcriptions asks the model with the audio (then the request's language and
    prompt, when given)."""
    translation_prompt: str = "Translate the speech in this audio into English."
    """What /v1/audio/translations asks the model with the audio (then the request's prompt)."""

    responses_store_bytes: int = 256 << 20
    """Bytes of stored responses (/v1/responses with store, OpenAI's default) kept in memory for
    previous_response_id and GET /v1/responses/{id}, least recently used dropped first; 0 stores none."""
    max_background_responses: int = 64
    """/v1/responses with background: true queued or running at once (each answered by a task of the
    server's, polled by GET); one more is a 429 with Retry-After."""

    allowed_origins: tuple[str, ...] = ()
    """Web origins whose pages may call this server from a browser (CORS), e.g. https://app.example.com,
    or * for any; repeat the flag for several. None by default (vLLM allows any): a server without an
    API key would otherwise answer any page its user opens."""
    allow_credentials: bool = False
    """CORS: browsers may send cookies and the Authorization header along (not with origin *)."""

    batch_concurrency: int = 16
    """Lines of a /v1/batches batch answered at once (batches run one after another); the engine
    batches them with the interactive requests, which keep the rest of its seats."""

    log_stats_interval_s: float = 10.0
    """Seconds between the engine lines on the log (throughput, running / waiting, KV use, cache hit
    rates; logger mmserve.stats), written while the engine works; 0: none (vLLM's --disable-log-stats)."""

    log_requests: bool = False
    """A log line per request however it ended (logger mmserve.requests): its id, finish reasons
    ("abort": cut short), prompt, cached and completion tokens as its usage counts them, n and the
    number of prompts, time to first token and total; no prompt or answer text. Off by default, as
    vLLM's --enable-log-requests."""

    return_tokens_as_token_ids: bool = False
    """Logprob entries name their token as "token_id:<id>" instead of its text (vLLM's flag), so a
    token that is no whole character -- a byte of a multi-byte one -- is still told apart; a
    request's own return_tokens_as_token_ids wins."""

    shutdown_timeout_s: float = 10.0
    """Seconds a stopping server (SIGTERM, SIGINT) lets requests in flight finish; then those still
    running are aborted (503, or a stream's error event then [DONE]) and the server exits."""

    def __post_init__(self) -> None:
        if not 0 <= self.shutdown_timeout_s < float("inf"):
            raise ValueError(f"shutdown_timeout_s must be a number of seconds >= 0, got {self.shutdown_timeout_s}")
        if self.max_upload_bytes <= 0 or self.max_files_total_bytes < self.max_upload_bytes:
            raise ValueError(f"need 0 < max_upload_bytes <= max_files_total_bytes, got {self.max_upload_bytes}, "
                             f"{self.max_files_total_bytes}")
        if self.max_audio_upload_bytes <= 0:
            raise ValueError(f"max_audio_upload_bytes must be > 0, got {self.max_audio_upload_bytes}")
        if not self.transcription_prompt.strip() or not self.translation_prompt.strip():
            raise ValueError("transcription_prompt and translation_prompt must not be empty")
        if not self.log_stats_interval_s >= 0:
            raise ValueError(f"log_stats_interval_s must be >= 0, got {self.log_stats_interval_s}")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials needs the origins named: browsers refuse credentials for origin *")
        if self.batch_concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        if self.max_background_responses < 1:
            raise ValueError(f"max_background_responses must be >= 1, got {self.max_background_responses}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got {self.responses_store_bytes}")
        if self.max_files < 1:
            raise ValueError(f"max_files must be >= 1, got {self.max_files}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_json_values < 1024:
            raise ValueError(f"max_json_values must be >= 1024, got {self.max_json_values}")
        if not self.request_body_idle_s > 0:
            raise ValueError(f"request_body_idle_s must be > 0, got {self.request_body_idle_s}")
        if self.max_json_objects < 1024:
            raise ValueError(f"max_json_objects must be >= 1024, got {self.max_json_objects}")
        if self.max_completion_prompts < 1:
            raise ValueError(f"max_completion_prompts must be >= 1, got {self.max_completion_prompts}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")

    @property
    def json_limits(self) -> JSONLimits:
        """What one request's JSON may be: a body, or a line of a batch file."""
        return JSONLimits(self.max_request_bytes, self.max_json_values, self.max_json_objects)
