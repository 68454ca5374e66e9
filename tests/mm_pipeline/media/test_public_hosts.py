"""The SSRF guard's address classifier (media/remote/public_hosts.is_public): IPv6 forms that embed
an IPv4 address are judged by that address, so a name on the allow-list whose AAAA record is a
NAT64 / 6to4 / Teredo / IPv4-compatible form of 127.0.0.1 or 169.254.169.254 is refused."""

from __future__ import annotations

import pytest

from mm_pipeline.media.remote.public_hosts import is_public


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "::", "::ffff:127.0.0.1", "fe80::1", "fc00::1",
    "64:ff9b::7f00:1",  # NAT64 well-known prefix, 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64, 169.254.169.254 (cloud metadata)
    "64:ff9b::a00:1",  # NAT64, 10.0.0.1
    "64:ff9b:1::808:808",  # local-use NAT64 prefix: refused whatever it embeds
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2001:0:808:808::f57f:fffe",  # Teredo, client 10.128.0.1 (obfuscated: bits inverted)
    "2001:0:a00:1::f7f7:f7f7",  # Teredo, server 10.0.0.1
    "::7f00:1",  # IPv4-compatible 127.0.0.1
    "::a9fe:a9fe",  # IPv4-compatible 169.254.169.254
    "::ffff:0:7f00:1",  # SIIT IPv4-translated 127.0.0.1 (not ipv4_mapped; Python calls it global)
    "::ffff:0:a9fe:a9fe",  # SIIT IPv4-translated 169.254.169.254
    "fec0::1", "feff::1",  # site-local fec0::/10
    "ff02::1", "224.0.0.1",  # multicast
])
def test_private_addresses_and_ipv6_forms_of_private_ipv4_are_not_public(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", [
    "8.8.8.8", "93.184.216.34", "2606:4700::1111", "2001:4860:4860::8888", "::ffff:8.8.8.8",
    "64:ff9b::808:808",  # NAT64 of a public address
    "2002:808:808::1",  # 6to4 of a public address
    "::ffff:0:808:808",  # SIIT IPv4-translated public address
])
def test_public_addresses_stay_public(address: str) -> None:
    assert is_public(address)
