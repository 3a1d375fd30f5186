"""Throwaway `redis-server` processes with a password, and with TLS (a self-signed certificate for 127.0.0.1), for
the tests of Redis AUTH and `rediss://` (tests/base/test_security.py, tests/ops/test_flower.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.polling import wait_for
from tests.support.ports import free_port


class PrivateRedis:
    """A throwaway `redis-server` with a password, no persistence, on a free port of 127.0.0.1."""

    def __init__(self, workdir: Path, *extra: str, password: str, tls: bool = False):
        if not shutil.which("redis-server"):
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        port_args = ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        self.proc = subprocess.Popen(["redis-server", *port_args, "--requirepass", password, "--save", "",
                                      "--appendonly", "no", "--bind", "127.0.0.1", "--dir", str(workdir), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait(self, url: str) -> None:
        import redis

        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited: {self.proc.stdout.read().decode(errors='replace')[-2000:]}")
            try:
                return redis.Redis.from_url(url, socket_timeout=1).ping()
            except redis.exceptions.ConnectionError:
                return False

        wait_for(up, 15, f"redis-server on port {self.port}", interval=0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1, valid one day; the certificate is its own CA."""
    if not shutil.which("openssl"):
        pytest.skip("openssl CLI not installed: cannot make a self-signed certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def exited_for_tls(server: PrivateRedis) -> bool:
    """Whether the server exited at start (a redis-server built without TLS refuses `--tls-port`)."""
    try:
        server.proc.wait(timeout=0.3)
    except subprocess.TimeoutExpired:
        return False
    return True


def tls_redis(folder: Path, password: str) -> tuple[PrivateRedis, str]:
    """A TLS-only private Redis with `password`, and the `rediss://` URL that checks its certificate; skips where
    redis-server has no TLS. The caller stops the server."""
    cert, key = self_signed_certificate(folder)
    server = PrivateRedis(folder, "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                          str(cert), "--tls-auth-clients", "no", password=password, tls=True)
    if exited_for_tls(server):
        pytest.skip("this redis-server was built without TLS support")
    url = f"rediss://:{password}@127.0.0.1:{server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    server.wait(url)
    return server, url
