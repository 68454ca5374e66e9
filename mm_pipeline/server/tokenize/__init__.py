"""vLLM's utility endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` (routes.py)
and their request bodies (protocol.py)."""
