"""Running mmserve beyond one process on Ray (an optional extra: ``pip install -e '.[ray]'``).

Nothing outside this package imports Ray; the CLI imports this package only when ``--ray`` is given,
so a plain install never needs Ray."""
