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


def is_public(address: str) -> bool:
    """A global unicast address (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


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
