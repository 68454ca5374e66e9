"""Remote media connects only to the public addresses it checked (no DNS-rebinding window).

An allowed media host must resolve to public addresses only: a name on the allow-list pointed at
127.0.0.1 or 169.254.169.254 would otherwise reach the server's own network. Checking the name and
then letting the HTTP client resolve it again to connect leaves a window in which a resolver with
a zero TTL answers a public address to the check and a private one to the connection (DNS
rebinding). So the check lives in the connection itself: the network backend below resolves the
host once, refuses the connection when any address is not public, and connects to one of exactly
the addresses it checked. TLS still verifies the certificate against the host *name* (httpcore
passes it to ``start_tls`` separately), so pinning the address changes nothing else.

    httpx.AsyncClient ─► PublicHostsTransport ─► httpcore pool ─► PublicAddressBackend.connect_tcp
                                                                   resolve once ─► all public? ─► connect(ip)
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Awaitable, Callable, Iterable

import httpcore
import httpx

from mm_pipeline.errors import MediaAccessDenied, MediaFetchError

# (host, port) -> the addresses it resolves to (tests swap in a scripted resolver)
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaFetchError(f"media host {host!r} does not resolve") from None
    return list(dict.fromkeys(info[4][0].split("%", 1)[0] for info in infos))


# IPv6 forms that carry an IPv4 address a gateway or tunnel may deliver to (each judged below)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix: the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215 local-use prefix (refused: below)
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d (RFC 4291 2.5.5.1)
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT ::ffff:0:a.b.c.d (RFC 2765 2.1)
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")  # deprecated (RFC 3879), still routed inside some sites


def is_public(address: str) -> bool:
    """A global unicast address. An IPv6 address embedding an IPv4 address is judged by that
    IPv4 address too: IPv4-mapped (as the IPv4 address alone), NAT64 64:ff9b::/96, 6to4
    2002::/16, Teredo 2001::/32 (its server and client), IPv4-compatible ::a.b.c.d and SIIT's
    IPv4-translated ::ffff:0:a.b.c.d (which ``ipv4_mapped`` does not see). A NAT64
    gateway, a 6to4 relay or a tunnel on the server's network delivers such an address to its
    IPv4 host, and Python's ``is_global`` (3.11) calls 64:ff9b::7f00:1 and 2002:a9fe:a9fe::1
    global. The local-use NAT64 prefix 64:ff9b:1::/48 and site-local fec0::/10 are refused
    outright: both reach only the local network's own translator or sites, and where a local-use
    prefix embeds its IPv4 address depends on the prefix length that network picked (RFC 6052 2.2),
    so there is no one IPv4 address to judge."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(str(ip.ipv4_mapped))
        if ip in _NAT64_LOCAL or ip in _SITE_LOCAL:
            return False
        embedded = _embedded_ipv4(ip)
        if embedded and not all(is_public(str(v4)) for v4 in embedded):
            return False
    return ip.is_global and not ip.is_multicast


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses ``ip`` carries (``is_public``'s list), or none."""
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE or ip in _IPV4_TRANSLATED:
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    return []


class PublicAddressBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend: resolve once, refuse non-public answers, connect to a checked address."""

    def __init__(self, resolver: Resolver = system_resolver,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._resolve = resolver
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        addresses = await self._resolve(host, port)
        if not addresses:
            raise MediaFetchError(f"media host {host!r} does not resolve")
        if not all(is_public(a) for a in addresses):
            raise MediaAccessDenied(f"media host {host!r} resolves to a non-public address")
        failure: Exception | None = None
        for address in addresses:  # as a client connecting by name would try them, in order
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        raise MediaAccessDenied("media is fetched over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PublicHostsTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connection pool on :class:`PublicAddressBackend`.

    httpx takes no network backend, so the pool it built is replaced by one built the same way with
    the backend (``_pool`` is what ``handle_async_request`` sends through; a test connects through
    this class and would fail if that changed)."""

    def __init__(self, resolver: Resolver = system_resolver,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                                  network_backend=PublicAddressBackend(resolver, inner))
