"""Answering the chat and text completions endpoints (the routes live in server/app.py): a request's
fields turned into the engine's parameters (request_params.py), its choices run and merged
(choices.py), the answer built or streamed (chat_service.py) with its token usage (token_usage.py),
and the facts sent as response headers beside it (answer_info.py); the fields chat and text
completions share (sampling_fields.py) and how a request asks for structured outputs
(structured_formats.py). The Batch and Responses APIs answer through the same service."""
