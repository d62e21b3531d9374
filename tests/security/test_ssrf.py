"""SSRF: every way a guest might make the host's HTTP client reach inward.

A loopback **canary** listens where no request may ever arrive; after every vector it must
have received zero connections. An allowlisted name (``api.test``) resolves, through the
policy's test resolver, to a separate loopback **server** the guest may use, which also
plays the hostile allowlisted server (redirects inward, huge and compressed bodies, header
floods, a slow drip). Each denial must reach the guest as ``CapabilityDenied`` with the one
uniform message; an allowed request that fails is an ``HttpError`` instead, and neither may
ever touch the canary.
"""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import wasibox
from tests.security.conftest import HostBaseline, take_baseline
from wasibox.capabilities.hostcall import DENIED_MESSAGE

pytestmark = pytest.mark.guest

GZIP_BOMB = gzip.compress(b"\0" * (64 * 2**20), compresslevel=9)  # 64 MiB in ~64 KiB


class _Server(http.server.BaseHTTPRequestHandler):
    canary_port = 0
    seen: list[tuple[str, str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.seen.append((self.path, self.headers.get("Host", "")))
        route = self.path.split("?")[0]
        if route.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?to=", 1)[1])
            self.end_headers()
        elif route == "/huge":
            self.send_response(200)
            self.end_headers()
            block = b"h" * 65536
            try:
                for _ in range(1024):  # 64 MiB, more than the policy's cap
                    self.wfile.write(block)
            except OSError:
                pass
        elif route == "/gzip":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(GZIP_BOMB)))
            self.end_headers()
            self.wfile.write(GZIP_BOMB)
        elif route == "/headers":
            self.send_response(200)
            for index in range(10_000):
                self.send_header(f"X-Flood-{index}", "v")
            self.end_headers()
        elif route == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"s")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        else:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")


@pytest.fixture(scope="module")
def canary() -> Iterator[socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


RESOLVED: dict[str, list[str]] = {
    "api.test": ["127.0.0.1"],  # allowlisted and opted in to loopback: the server
    "inward.test": ["127.0.0.1"],  # allowlisted, but resolves inward
    "mixed.test": ["93.184.216.34", "127.0.0.1"],  # one good address, one inward
    "meta.test": ["169.254.169.254"],
    "v6inward.test": ["::ffff:127.0.0.1"],
}
REBIND_CALLS: list[str] = []


def resolve(name: str) -> list[str]:
    if name == "rebind.test":  # public first, loopback for anyone who asks again
        REBIND_CALLS.append(name)
        return ["93.184.216.34"] if len(REBIND_CALLS) == 1 else ["127.0.0.1"]
    return RESOLVED.get(name, [])


@pytest.fixture(scope="module")
def ports(canary: socket.socket, server: http.server.ThreadingHTTPServer) -> tuple[int, int]:
    return canary.getsockname()[1], server.server_address[1]


@pytest.fixture(scope="module")
def sb(ports: tuple[int, int]) -> Iterator[wasibox.Sandbox]:
    canary_port, port = ports
    # Everything but api.test is allowlisted on both ports, so only the address checks
    # stand between these names and the canary. api.test, opted in to loopback, is
    # allowlisted on the server's port only.
    names = ["inward.test", "mixed.test", "meta.test", "v6inward.test", "rebind.test",
             "127.0.0.1", "169.254.169.254", "localhost", "[::1]", "metadata.google.internal"]
    allow = [f"api.test:{port}"] + [f"{name}:{p}" for name in names
                                    for p in (port, canary_port)]
    allow += ["169.254.169.254", "metadata.google.internal", "100.100.100.200"]
    policy = wasibox.HttpPolicy(allow=allow, resolver=resolve, allow_loopback=["api.test"],
                                methods=("GET",), max_response_bytes="1MiB", timeout_s=2,
                                max_redirects=3, max_header_count=100)
    limits = wasibox.Limits(timeout_s=20, fuel=5_000_000_000)
    with wasibox.Sandbox(limits, http=policy, clock="real") as sandbox:
        yield sandbox


@pytest.fixture()
def host(sb: wasibox.Sandbox, ports: tuple[int, int]) -> HostBaseline:
    # Warm the host-call worker (it idles out after 30 s) so the baseline includes it.
    assert fetch(sb, f"http://api.test:{ports[1]}/")[0] == "ok"
    return take_baseline(sb)


def fetch(sb: wasibox.Sandbox, url: str, **options: Any) -> tuple[str, str]:
    """(exception type or 'ok', message or body) for host.http.request from the guest."""
    r = sb.run("import host\ntry:\n"
               f"    response = host.http.request('GET', {url!r}, **{options!r})\n"
               "    print('ok', response.status, response.body[:20])\n"
               "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    assert r.error is None, r.error
    kind, _, message = r.stdout.strip().partition(" ")
    return kind, message


def assert_canary_untouched(canary: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        connection, _ = canary.accept()
        connection.close()


def vectors(canary_port: int) -> dict[str, str]:
    c = canary_port
    return {
        "loopback literal": f"http://127.0.0.1:{c}/",
        "loopback, short form": f"http://127.1:{c}/",
        "loopback, decimal": f"http://2130706433:{c}/",
        "loopback, hex": f"http://0x7f000001:{c}/",
        "loopback, octal": f"http://017700000001:{c}/",
        "loopback, dotted octal": f"http://0177.0.0.1:{c}/",
        "loopback, mixed": f"http://0x7f.0.0.01:{c}/",
        "loopback, trailing dot": f"http://127.0.0.1.:{c}/",
        "loopback, IPv6": f"http://[::1]:{c}/",
        "IPv4-mapped IPv6": f"http://[::ffff:127.0.0.1]:{c}/",
        "IPv4-mapped IPv6, hex": f"http://[::ffff:7f00:1]:{c}/",
        "IPv4-compatible IPv6": f"http://[::127.0.0.1]:{c}/",
        "NAT64": f"http://[64:ff9b::7f00:1]:{c}/",
        "6to4": f"http://[2002:7f00:1::]:{c}/",
        "unspecified": f"http://0.0.0.0:{c}/",
        "unspecified IPv6": f"http://[::]:{c}/",
        "localhost": f"http://localhost:{c}/",
        "metadata": "http://169.254.169.254/latest/meta-data/",
        "metadata, decimal": "http://2852039166/",
        "metadata, hex": "http://0xa9fea9fe/",
        "metadata, octal": "http://0251.0376.0251.0376/",
        "metadata, mixed": "http://0xa9.254.0251.0376/",
        "metadata, two parts": "http://169.254.43518/",
        "metadata, IPv4-mapped": "http://[::ffff:169.254.169.254]/",
        "metadata, AWS IPv6": "http://[fd00:ec2::254]/",
        "metadata, Alibaba": "http://100.100.100.200/",
        "metadata, GCP name": "http://metadata.google.internal/computeMetadata/v1/",
        "private 10/8": "http://10.0.0.1/",
        "private 192.168/16": "http://192.168.1.1/",
        "private 172.16/12": "http://172.16.0.1/",
        "CGNAT": "http://100.64.0.1/",
        "link-local IPv6": "http://[fe80::1]/",
        "allowlisted name resolving inward": f"http://inward.test:{c}/",
        "one inward address among good ones": f"http://mixed.test:{c}/",
        "name resolving to metadata": "http://meta.test/",
        "name resolving to mapped loopback": f"http://v6inward.test:{c}/",
        "scheme: file": "file:///etc/passwd",
        "scheme: gopher": f"gopher://127.0.0.1:{c}/",
        "scheme: ftp": f"ftp://api.test:{c}/",
        "scheme: none": f"//127.0.0.1:{c}/",
        "userinfo": f"http://api.test@127.0.0.1:{c}/",
        "userinfo with the allowed host": f"http://127.0.0.1:{c}@api.test/",
        "backslash": f"http://127.0.0.1:{c}\\@api.test/",
        "backslash in host": f"http://api.test\\.127.0.0.1:{c}/",
        "whitespace": f"http://127.0.0.1:{c} /",
        "tab in host": f"http://127.0.0.1\t:{c}/",
        "CRLF in URL": f"http://api.test:{c}/\r\nHost: 127.0.0.1",
        "NUL in host": f"http://127.0.0.1\x00.api.test:{c}/",
        "percent-encoded host": f"http://%31%32%37.0.0.1:{c}/",
        "percent-encoded dot": f"http://api%2etest:{c}/",
        "suffix match": f"http://api.test.127.0.0.1.nip.io:{c}/",
        "prefix match": f"http://evilapi.test:{c}/",
        "port not allowlisted": "http://api.test:1/",
        "IDN homograph": f"http://\u0430pi.test:{c}/",
        "fullwidth digits": f"http://\uff11\uff12\uff17.0.0.1:{c}/",
    }


def test_every_ssrf_vector_is_denied_and_never_reaches_the_canary(
        sb: wasibox.Sandbox, host: HostBaseline, ports: tuple[int, int],
        canary: socket.socket) -> None:
    outcomes = {name: fetch(sb, url) for name, url in vectors(ports[0]).items()}
    wrong = {name: outcome for name, outcome in outcomes.items()
             if outcome != ("CapabilityDenied", DENIED_MESSAGE)}
    # file:// never reaches the HTTP client: urllib's own handler, and the guest has no files.
    assert wrong == {}, wrong
    assert_canary_untouched(canary)
    host.assert_unaffected(sb)


def test_the_allowlisted_server_is_reachable(sb: wasibox.Sandbox, ports: tuple[int, int],
                                             canary: socket.socket) -> None:
    # The positive control: without it, "every vector is denied" could mean "all is broken".
    assert fetch(sb, f"http://api.test:{ports[1]}/") == ("ok", "200 b'ok'")
    r = sb.run(f"import urllib.request\nprint(urllib.request.urlopen("
               f"'http://api.test:{ports[1]}/').read())")
    assert r.stdout == "b'ok'\n"
    assert_canary_untouched(canary)


def test_dns_rebinding_cannot_move_the_connection(sb: wasibox.Sandbox, ports: tuple[int, int],
                                                  canary: socket.socket) -> None:
    REBIND_CALLS.clear()
    kind, _ = fetch(sb, f"http://rebind.test:{ports[0]}/")
    # Resolved once, to the public address: the connection goes there (and fails, offline)
    # and is never re-resolved to loopback.
    assert kind in ("HttpError", "ok")
    assert REBIND_CALLS == ["rebind.test"]
    assert_canary_untouched(canary)


@pytest.mark.parametrize("target", [
    "http://127.0.0.1:{c}/", "http://inward.test:{c}/", "http://169.254.169.254/",
    "http://0x7f000001:{c}/", "file:///etc/passwd", "gopher://127.0.0.1:{c}/",
    "http://api.test:{c}/",  # the allowlisted name, on the canary's port: not allowlisted
])
def test_redirects_inward_or_to_other_schemes_are_denied(
        sb: wasibox.Sandbox, host: HostBaseline, ports: tuple[int, int], canary: socket.socket,
        target: str) -> None:
    url = f"http://api.test:{ports[1]}/redirect/?to=" + target.format(c=ports[0])
    assert fetch(sb, url) == ("CapabilityDenied", DENIED_MESSAGE)
    assert_canary_untouched(canary)
    host.assert_unaffected(sb)


def test_host_header_and_crlf_injection_do_not_steer_the_request(
        sb: wasibox.Sandbox, ports: tuple[int, int], canary: socket.socket) -> None:
    _Server.seen.clear()
    url = f"http://api.test:{ports[1]}/inject"
    kind, _ = fetch(sb, url, headers={"Host": f"127.0.0.1:{ports[0]}"})
    assert kind == "ok"
    assert _Server.seen == [("/inject", f"api.test:{ports[1]}")]
    kind, _ = fetch(sb, url, headers={"X-Injected": f"a\r\nHost: 127.0.0.1:{ports[0]}"})
    assert kind in ("CapabilityDenied", "HostError", "ValueError")
    assert len(_Server.seen) == 1
    assert_canary_untouched(canary)


@pytest.mark.parametrize("route", ["/huge", "/gzip", "/headers", "/slow"])
def test_hostile_responses_from_an_allowlisted_server_are_contained(
        sb: wasibox.Sandbox, host: HostBaseline, ports: tuple[int, int], canary: socket.socket,
        route: str) -> None:
    started = time.monotonic()
    kind, message = fetch(sb, f"http://api.test:{ports[1]}{route}")
    assert kind == "HttpError", (kind, message)
    assert time.monotonic() - started < 15  # generous: the policy's deadline is 2 s
    assert_canary_untouched(canary)
    host.assert_unaffected(sb)
