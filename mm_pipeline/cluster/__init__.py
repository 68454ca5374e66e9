"""Running mmserve beyond one process on Ray (an optional extra: ``pip install -e '.[ray]'``).

Nothing outside this package imports Ray, and nothing here imports it at module level: the CLI
builds its ``--ray`` flags from ray_flags.py on every run and reaches the rest only when ``--ray`` is
given, so a plain install never needs Ray."""
