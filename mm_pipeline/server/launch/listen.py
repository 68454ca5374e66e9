"""Listen: where and how ``mmserve serve`` takes connections -- host, port, TLS, root path.

TLS is vLLM's set of flags (``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``), handed to uvicorn (single server) or to Ray Serve's HTTP proxy (``--ray``), so a
server reachable beyond loopback need not send prompts, media and API keys in the clear. The
certificate and key are loaded once here before the model is (a wrong path, a key that does not match
its certificate, a password-protected key are usage errors naming the flag, not a traceback minutes
later when uvicorn binds). ``--enable-ssl-refresh`` (vLLM's) reloads them into the live context
when the files change (a certificate renewed by cert-manager or certbot): new connections get the
new certificate, open ones keep theirs, no restart. ``--root-path`` is the path prefix a reverse
proxy serves the app under (uvicorn's / Ray's ``root_path``): the OpenAPI page and its links then
carry it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Callable

from mm_pipeline.server.launch.http_protocol import protocol_kwargs

log = logging.getLogger(__name__)
REFRESH_POLL_S = 2.0  # how often the files' stat is compared (a few syscalls)
LISTEN_BACKLOG = 2048  # uvicorn's default backlog

CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # CA bundle client certificates are checked against
    ssl_cert_reqs: int = 0  # 0: no client certificate asked, 1: checked when sent, 2: required (mutual TLS)
    root_path: str = ""
    ssl_refresh: bool = False  # reload the certificate files into the live context when they change

    def __post_init__(self) -> None:
        if not self.host.strip():  # the resolver takes "" as every interface: say 0.0.0.0 for that
            raise ValueError("--host must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (the key and its certificate)")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if not self.tls and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs / --ssl-cert-reqs need TLS on (--ssl-keyfile and --ssl-certfile)")
        if self.ssl_refresh and not self.tls:
            raise ValueError("--enable-ssl-refresh needs TLS on (--ssl-keyfile and --ssl-certfile)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs: give it")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one (e.g. /mmserve), "
                             f"got {self.root_path!r}")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def base_url(self) -> str:
        """Where this server answers: the app at / (uvicorn and Ray Serve's proxy alike take the root
        path as the prefix a reverse proxy in front strips before forwarding)."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def describe(self) -> str:
        """The start-up line's URL: where this server answers, and the proxy's path to it, if any."""
        return f"{self.base_url}/v1 (also /health, /metrics)" + (
            f"; through the reverse proxy: {self.root_path}/v1" if self.root_path else "")

    def check(self) -> None:
        """Load the certificate chain (and the CA bundle) as the server will: ValueError naming the
        flag when one cannot be used. Cheap (milliseconds); call before loading the model."""
        if not self.tls:
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # a password-protected key would prompt on the terminal: refuse it instead of hanging a service
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=_no_password)
        except (OSError, ssl.SSLError, ValueError, TypeError) as exc:
            raise ValueError(f"--ssl-certfile {self.ssl_certfile} / --ssl-keyfile {self.ssl_keyfile}: "
                             f"cannot be used ({_reason(exc)})") from None
        if self.ssl_ca_certs is not None:
            try:
                context.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ValueError(f"--ssl-ca-certs {self.ssl_ca_certs}: cannot be used ({_reason(exc)})") from None

    def bind(self) -> tuple[socket.socket, "Listen"]:
        """The server's socket, bound now -- before the model loads, so a port in use or a host that
        does not resolve is a ValueError naming the flag, not uvicorn exiting minutes later -- and
        this Listen with the port bound (``--port 0``: the one the system chose), for the start-up
        line. uvicorn listens on it (``Server.run(sockets=[sock])``)."""
        try:
            family, kind, proto, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as exc:
            raise ValueError(f"--host {self.host}: not an address of this machine ({exc.strerror})") from None
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind: no wait after a restart
        try:
            sock.bind(address)
            # listening now, not when uvicorn starts: two sockets with SO_REUSEADDR may both bind one
            # port while neither listens, so a second server started beside this one would load its
            # model and only then fail inside uvicorn; a listening socket makes its bind fail here.
            # Connections made while the model loads wait in the backlog.
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise ValueError(f"--port {self.port} / --host {self.host}: cannot listen there "
                             f"({exc.strerror or exc})") from None
        return sock, dataclasses.replace(self, port=sock.getsockname()[1])

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords (host, port, TLS, root path)."""
        kw: dict[str, Any] = {"host": self.host, "port": self.port, "root_path": self.root_path,
                              **protocol_kwargs()}  # a bounded request head (http_protocol.py)
        if self.tls:
            kw.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile, ssl_cert_reqs=self.ssl_cert_reqs)
            if self.ssl_ca_certs is not None:
                kw["ssl_ca_certs"] = self.ssl_ca_certs
            if self.ssl_refresh:
                kw["ssl_context_factory"] = self._refreshed_context
        return kw

    def _refreshed_context(self, _config: Any, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        """uvicorn's ``ssl_context_factory``: its own context, watched for changes of the files."""
        context = default()
        CertificateRefresher(context, self).start()
        return context

    def ray_http_options(self) -> dict[str, Any]:
        """Ray Serve's ``http_options``. Its proxy takes a certificate and a CA bundle but has no
        setting for asking clients for theirs, so ``ssl_cert_reqs`` > 0 is refused with ``--ray``."""
        if self.ssl_cert_reqs:
            raise ValueError("--ssl-cert-reqs with --ray: Ray Serve's proxy cannot ask for client certificates "
                             "(terminate mutual TLS at a proxy in front of it)")
        if self.ssl_refresh:
            raise ValueError("--enable-ssl-refresh with --ray: Ray Serve's proxy loads its certificate once "
                             "(restart the application to renew it)")
        kw: dict[str, Any] = {"host": self.host, "port": self.port}
        if self.root_path:
            kw["root_path"] = self.root_path
        if self.tls:
            kw.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile)
            if self.ssl_ca_certs is not None:
                kw["ssl_ca_certs"] = self.ssl_ca_certs
        return kw


class CertificateRefresher(threading.Thread):
    """Polls the stat (inode, size, mtime) of the key, certificate and CA files every
    REFRESH_POLL_S; on a change loads them into ``context``, which new handshakes then use. A load
    that fails (a renewal caught half-written, a key not yet matching its certificate) keeps the
    old certificate and is tried again at the next change or poll, with a warning. A daemon: it ends
    with the process."""

    def __init__(self, context: ssl.SSLContext, listen: Listen, poll_s: float | None = None) -> None:
        super().__init__(name="mmserve-ssl-refresh", daemon=True)
        self.context, self.listen = context, listen
        self.poll_s = REFRESH_POLL_S if poll_s is None else poll_s
        self.stopped = threading.Event()
        self.reloads = 0  # certificates loaded since the start (tests, logs)
        self._seen = self._stamp()
        self._failed: tuple | None = None  # the stamp whose load failed: warned about once

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            stamp = self._stamp()
            if stamp == self._seen:
                continue
            try:
                self.context.load_cert_chain(self.listen.ssl_certfile, self.listen.ssl_keyfile, password=_no_password)
                if self.listen.ssl_ca_certs is not None:
                    self.context.load_verify_locations(self.listen.ssl_ca_certs)
            except (OSError, ssl.SSLError, ValueError, TypeError) as exc:
                if stamp != self._failed:
                    log.warning("TLS certificate files changed but cannot be loaded yet (%s); keeping the old one",
                                _reason(exc))
                    self._failed = stamp
                continue
            self._seen, self.reloads = stamp, self.reloads + 1
            log.info("TLS certificate reloaded from %s", self.listen.ssl_certfile)

    def _stamp(self) -> tuple:
        out = []
        for path in (self.listen.ssl_keyfile, self.listen.ssl_certfile, self.listen.ssl_ca_certs):
            try:
                st = os.stat(path) if path is not None else None
            except OSError:
                st = None  # mid-rename: compared as a change, loaded once it is back
            out.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)


def _no_password() -> bytes:
    raise ValueError("the key is encrypted; give an unencrypted key file (its permissions protect it)")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc) or type(exc).__name__
