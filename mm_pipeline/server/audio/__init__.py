"""OpenAI's audio API over the omni model: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``
(routes.py, the form's fields: protocol.py)."""
