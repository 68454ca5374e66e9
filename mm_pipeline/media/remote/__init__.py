"""Media fetched from http(s) URLs: the bounded fetch (fetch.py) and the rule that only public
hosts are reached (public_hosts.py)."""
