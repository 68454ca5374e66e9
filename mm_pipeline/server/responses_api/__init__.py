"""OpenAI's Responses API over the omni model: ``/v1/responses`` (routes.py; the request and the chat
it becomes: protocol.py; the response object: output.py; streamed events: events.py; stored
responses: store.py; background responses while they run: background.py)."""
