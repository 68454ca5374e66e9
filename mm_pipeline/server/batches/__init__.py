"""OpenAI's Batch API on the server (``/v1/batches``: routes.py, runner.py, protocol.py) and the batch-file
line format it shares with ``mmserve batch`` (lines.py)."""
