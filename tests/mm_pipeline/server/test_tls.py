"""HTTPS with vLLM's flags: ``mmserve serve --ssl-keyfile --ssl-certfile`` answers over TLS only (a
client trusting the certificate gets answers, plain HTTP and an untrusting client get none), with
``--ssl-ca-certs --ssl-cert-reqs 2`` only clients holding a certificate from that CA; ``--root-path``
reaches the OpenAPI page's links. Bad settings are usage errors before the model loads. Certificates
are made here (cryptography), for 127.0.0.1 only."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl

import httpx
import pytest

from mm_pipeline.server.launch.listen import Listen
from tests.support.paths import DEMO_MODEL

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _issue(name: str, issuer_key=None, issuer_name=None, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(folder, stem: str, key, cert, password: bytes | None = None) -> tuple[str, str]:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8, enc))
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(folder / f"{stem}.key"), str(folder / f"{stem}.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate it signed, a client certificate it signed, and a stranger's."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("mmserve test CA", ca=True)
    out = {"ca": _write(d, "ca", ca_key, ca_cert)[1]}
    out["server"] = _write(d, "server", *_issue("127.0.0.1", ca_key, ca_cert.subject))
    out["client"] = _write(d, "client", *_issue("client", ca_key, ca_cert.subject))
    out["stranger"] = _write(d, "stranger", *_issue("stranger"))
    out["locked"] = _write(d, "locked", *_issue("127.0.0.1", ca_key, ca_cert.subject), password=b"secret")
    return out


def test_settings_are_checked(pki) -> None:
    key, cert = pki["server"]
    cases = [(dict(ssl_keyfile=key), "go together"), (dict(ssl_cert_reqs=2), "need TLS on"),
             (dict(ssl_keyfile=key, ssl_certfile=cert, ssl_cert_reqs=2), "give it"),
             (dict(ssl_keyfile=key, ssl_certfile=cert, ssl_cert_reqs=3), "must be 0"),
             (dict(root_path="mmserve"), "must start with '/'"), (dict(root_path="/a/"), "must start with '/'")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            Listen(**kw)
    for kw, match in [(dict(ssl_keyfile=pki["client"][0], ssl_certfile=cert), "cannot be used"),  # key of another cert
                      (dict(ssl_keyfile=key + ".nope", ssl_certfile=cert), "cannot be used"),
                      (dict(ssl_keyfile=pki["locked"][0], ssl_certfile=pki["locked"][1]), "encrypted"),
                      (dict(ssl_keyfile=key, ssl_certfile=cert, ssl_ca_certs=key + ".nope"), "--ssl-ca-certs")]:
        with pytest.raises(ValueError, match=match):
            Listen(**kw).check()
    tls = Listen(port=8443, ssl_keyfile=key, ssl_certfile=cert, root_path="/m")
    tls.check()
    assert tls.base_url == "https://127.0.0.1:8443"  # the proxy in front strips /m
    assert tls.describe() == ("https://127.0.0.1:8443/v1 (also /health, /metrics); "
                              "through the reverse proxy: /m/v1")
    assert tls.uvicorn_kwargs()["ssl_certfile"] == cert and tls.ray_http_options()["root_path"] == "/m"
    with pytest.raises(ValueError, match="Ray Serve's proxy cannot ask for client certificates"):
        Listen(ssl_keyfile=key, ssl_certfile=cert, ssl_ca_certs=pki["ca"], ssl_cert_reqs=2).ray_http_options()


def test_cli_refuses_bad_tls_before_loading_the_model(pki, capsys) -> None:
    from mm_pipeline import cli

    assert cli.main(["serve", "--model", str(DEMO_MODEL), "--ssl-keyfile", pki["server"][0]]) == 2
    assert "go together" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(DEMO_MODEL), "--ssl-keyfile", pki["client"][0],
                     "--ssl-certfile", pki["server"][1]]) == 2
    err = capsys.readouterr().err
    assert "cannot be used" in err and "loading" not in err  # before the model


def _served_serial(port: int, ca: str, client: tuple[str, str] | None = None) -> int:
    """The serial number of the certificate a TLS server on 127.0.0.1:``port`` presents now."""
    ctx = ssl.create_default_context(cafile=ca)
    if client is not None:
        ctx.load_cert_chain(client[1], client[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _renew(pki, folder, stem: str) -> int:
    """A new certificate for 127.0.0.1 from the same CA written over ``folder/stem.*``; its serial."""
    import shutil

    ca_key = serialization.load_pem_private_key(open(pki["ca"][:-4] + ".key", "rb").read(), None)
    ca_cert = x509.load_pem_x509_certificate(open(pki["ca"], "rb").read())
    key, cert = _issue("127.0.0.1", ca_key, ca_cert.subject)
    tmp = folder / "renewed"
    tmp.mkdir(exist_ok=True)
    new_key, new_cert = _write(tmp, stem, key, cert)
    shutil.move(new_key, folder / f"{stem}.key")  # renames, as certbot and cert-manager swap files
    shutil.move(new_cert, folder / f"{stem}.pem")
    return cert.serial_number


def test_the_refresher_loads_a_renewed_certificate_and_keeps_the_old_one_on_a_bad_file(pki, tmp_path) -> None:
    import shutil
    import threading
    import time

    from mm_pipeline.server.launch.listen import CertificateRefresher

    for ext in ("key", "pem"):
        shutil.copy(pki["server"][0 if ext == "key" else 1], tmp_path / f"live.{ext}")
    listen = Listen(ssl_keyfile=str(tmp_path / "live.key"), ssl_certfile=str(tmp_path / "live.pem"), ssl_refresh=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(listen.ssl_certfile, listen.ssl_keyfile)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:  # one handshake per connection, with the live context
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass

    threading.Thread(target=serve, daemon=True).start()
    refresher = CertificateRefresher(context, listen, poll_s=0.05)
    refresher.start()
    try:
        first = _served_serial(port, pki["ca"])
        (tmp_path / "live.pem").write_text("-----BEGIN CERTIFICATE-----\nhalf written")  # a renewal caught mid-way
        time.sleep(0.3)
        assert refresher.reloads == 0 and _served_serial(port, pki["ca"]) == first  # the old one stays
        renewed = _renew(pki, tmp_path, "live")
        deadline = time.monotonic() + 10
        while refresher.reloads == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refresher.reloads == 1 and _served_serial(port, pki["ca"]) == renewed != first
    finally:
        refresher.stopped.set()
        server.close()
    with pytest.raises(ValueError, match="needs TLS on"):
        Listen(ssl_refresh=True)
    with pytest.raises(ValueError, match="--enable-ssl-refresh with --ray"):
        listen.ray_http_options()


@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
def test_serve_over_mutual_tls_with_a_root_path(pki, tmp_path) -> None:
    import shutil
    import time

    from mm_pipeline.server.launch.server_process import ServerProcess

    shutil.copy(pki["server"][0], tmp_path / "live.key")  # renewed below, under the running server
    shutil.copy(pki["server"][1], tmp_path / "live.pem")
    key, cert = str(tmp_path / "live.key"), str(tmp_path / "live.pem")
    args = ["--model", str(DEMO_MODEL), "--device", "cpu", "--ssl-keyfile", key, "--ssl-certfile", cert,
            "--ssl-ca-certs", pki["ca"], "--ssl-cert-reqs", "2", "--root-path", "/mmserve", "--enable-ssl-refresh"]

    def client_context(which: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        if which is not None:
            ctx.load_cert_chain(pki[which][1], pki[which][0])
        return ctx

    # the readiness check is a client too: it must present a certificate of the CA
    with ServerProcess(args, verify=client_context("client")) as server:
        assert server.base_url.startswith("https://")
        # where it answers (the proxy strips its prefix before forwarding), and the proxy's path
        assert f"serving   demo-model on https://127.0.0.1:{server.port}/v1 " in server.output
        assert "through the reverse proxy: /mmserve/v1" in server.output
        with httpx.Client(base_url=server.base_url, verify=client_context("client"), timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                     "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            assert "/mmserve/openapi.json" in c.get("/docs").text  # the proxy's prefix in the page's links
        for ctx in (client_context(None), client_context("stranger")):  # no client certificate, a foreign one
            with pytest.raises(httpx.TransportError):
                httpx.get(server.base_url + "/health", verify=ctx, timeout=10)
        with pytest.raises(httpx.TransportError):  # a client that does not trust the server's certificate
            httpx.get(server.base_url + "/health", verify=ssl.create_default_context(), timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        # --enable-ssl-refresh: a renewed certificate is served to new connections, no restart
        first = _served_serial(server.port, pki["ca"], pki["client"])
        renewed = _renew(pki, tmp_path, "live")
        deadline = time.monotonic() + 20
        while _served_serial(server.port, pki["ca"], pki["client"]) != renewed and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _served_serial(server.port, pki["ca"], pki["client"]) == renewed != first
        assert httpx.get(server.base_url + "/health", verify=client_context("client"), timeout=10).status_code == 200
