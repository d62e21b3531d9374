"""Mediated HTTP: allowed requests, every SSRF vector, redirects, bombs, caps and deadlines.

Two real HTTP servers listen on 127.0.0.1: ``origin`` serves the allowed requests, and
``canary`` is where every SSRF vector points. The canary counts the TCP connections it
accepts, and after each hostile case it must have counted **zero**. A test-only resolver
points the test names at loopback; loopback stays denied unless a name opts in.
"""

from __future__ import annotations

import gzip
import http.server
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import trustme

import wasibox
from tests.conftest import open_fds
from wasibox import Limit
from wasibox.capabilities.hostcall import DENIED_MESSAGE
from wasibox.capabilities.http import address_allowed, parse_url

pytestmark = pytest.mark.guest

BOMB = gzip.compress(bytes(32 * 2**20), compresslevel=9)  # 32 MiB of zeros in ~32 KiB
SMALL_GZIP = gzip.compress(b"squeezed " * 100)


class Server(http.server.ThreadingHTTPServer):
    """A real HTTP server on 127.0.0.1 that counts the connections it accepts."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self.lock:
            self.connections += 1
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (a timeout test) leaves a broken pipe: expected here

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.respond()

    def do_POST(self) -> None:  # noqa: N802
        self.respond()

    def do_HEAD(self) -> None:  # noqa: N802
        self.respond()

    def do_DELETE(self) -> None:  # noqa: N802
        self.respond()

    def send(self, status: int, body: bytes, headers: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def respond(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        path = url.path
        if path == "/hello":
            self.send(200, b"hello from the origin", [("X-Origin", "yes")])
        elif path == "/echo":
            size = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(size)
            self.send(200, json.dumps({
                "method": self.command, "path": self.path, "body": body.decode("latin-1"),
                "headers": {k.lower(): v for k, v in self.headers.items()},
            }).encode(), [("Content-Type", "application/json")])
        elif path == "/redirect":
            self.send(int(query.get("code", "302")), b"", [("Location", query["to"])])
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            if left == 0:
                self.send(200, b"end of chain")
            else:
                self.send(302, b"", [("Location", f"/chain/{left - 1}")])
        elif path == "/set-cookie":
            self.send(302, b"", [("Set-Cookie", "session=stolen"), ("Location", "/echo")])
        elif path == "/gzip-bomb":
            self.send(200, BOMB, [("Content-Encoding", "gzip")])
        elif path == "/gzip":
            self.send(200, SMALL_GZIP, [("Content-Encoding", "gzip")])
        elif path == "/brotli":
            self.send(200, b"\x0b\x02\x80hello\x03", [("Content-Encoding", "br")])
        elif path == "/big":
            self.send(200, b"b" * (2 * 2**20))
        elif path == "/many-headers":
            self.send(200, b"x", [(f"X-H{i}", "v") for i in range(500)])
        elif path == "/huge-header":
            self.send(200, b"x", [("X-Huge", "h" * 200_000)])
        elif path == "/slow":
            time.sleep(float(query.get("s", "3")))
            self.send(200, b"late")
        elif path == "/status":
            self.send(int(query["code"]), b"status body")
        else:
            self.send(404, b"not found")


def start(server: Server) -> Server:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def origin() -> Iterator[Server]:
    server = start(Server())
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def canary() -> Iterator[Server]:
    server = start(Server())
    yield server
    server.shutdown()
    server.server_close()


class Names:
    """The test-only resolver: test names to addresses, counting lookups."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.lookups: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.lookups.append(name)
        if name not in self.table:
            raise OSError("no such name")
        return self.table[name]


def policy(origin: Server, canary: Server, **changes: Any) -> wasibox.HttpPolicy:
    """A policy as permissive as the checks allow, so a vector is stopped by a check."""
    o, c = origin.port, canary.port
    settings: dict[str, Any] = dict(
        allow=[f"api.test:{o}", f"other.test:{o}", f"*.wild.test:{o}", f"bücher.test:{o}",
               f"127.0.0.1:{c}", f"localhost:{c}", f"inward.test:{c}", f"private.test:{c}",
               f"mixed.test:{c}", f"metadata.google.internal:{c}", f"[::1]:{c}",
               f"[::ffff:127.0.0.1]:{c}", f"0.0.0.0:{c}"],
        methods=("GET", "POST", "HEAD"), max_response_bytes="1MiB", timeout_s=5,
        max_redirects=3,
        resolver=Names({
            "api.test": ["127.0.0.1"], "other.test": ["127.0.0.1"], "a.wild.test": ["127.0.0.1"],
            "xn--bcher-kva.test": ["127.0.0.1"], "localhost": ["127.0.0.1"],
            "inward.test": ["127.0.0.1"], "private.test": ["10.1.2.3"],
            "mixed.test": ["100.0.0.1", "127.0.0.1"], "metadata.google.internal": ["127.0.0.1"],
        }),
        allow_loopback=["api.test", "other.test", "a.wild.test", "bücher.test",
                        "metadata.google.internal"])
    settings.update(changes)
    return wasibox.HttpPolicy(**settings)


GUEST = """\
import host
try:
    r = host.http.request({method!r}, {url!r}, headers={headers!r}, body={body!r})
    print('ok', r.status, r.body[:200])
except host.CapabilityDenied as e:
    print('denied', isinstance(e, PermissionError), e)
except host.HttpError as e:
    print('error', isinstance(e, OSError), e)
"""


def fetch(sb: wasibox.Sandbox, url: str, method: str = "GET",
          headers: Any = None, body: bytes | None = None) -> wasibox.RunResult:
    return sb.run(GUEST.format(method=method, url=url, headers=headers, body=body))


@pytest.fixture()
def sb(origin: Server, canary: Server) -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(http=policy(origin, canary)) as sandbox:
        yield sandbox


@pytest.fixture()
def fds() -> int:
    return open_fds()


def assert_unharmed(sb: wasibox.Sandbox, canary: Server, fds_before: int) -> None:
    """The canary saw nothing, the next run works, and no host fd leaked."""
    assert canary.connections == 0
    after = sb.run("print(sum(range(10)))")
    assert after.ok and after.stdout == "45\n"
    deadline = time.monotonic() + 5  # a server thread may still be closing its side
    while open_fds() > fds_before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds() <= fds_before + 2


# -- allowed requests ----------------------------------------------------------------------------

def test_get_through_the_guest_api(sb: wasibox.Sandbox, origin: Server) -> None:
    r = sb.run(f"import host\nr = host.http.request('GET', 'http://api.test:{origin.port}/hello')"
               "\nprint(r.status, r.reason, r.body, r.header('x-origin'), r.url)")
    assert r.ok, r.error
    assert r.stdout == (f"200 OK b'hello from the origin' yes "
                        f"http://api.test:{origin.port}/hello\n")
    (event,) = r.capability_log
    assert (event.capability, event.action, event.allowed) == ("http", "GET", True)
    assert event.target == f"http://api.test:{origin.port}/hello"
    assert event.bytes_received == len(b"hello from the origin") and event.duration_s > 0


def test_urlopen_works_unchanged(sb: wasibox.Sandbox, origin: Server) -> None:
    code = f"""\
import json, urllib.request, urllib.error
with urllib.request.urlopen('http://api.test:{origin.port}/hello') as response:
    print(response.status, response.read(), response.headers['X-Origin'])
request = urllib.request.Request('http://api.test:{origin.port}/echo', data=b'payload',
                                 headers={{'X-Token': 'abc'}}, method='POST')
echo = json.loads(urllib.request.urlopen(request).read())
print(echo['method'], echo['body'], echo['headers']['x-token'], echo['headers']['host'])
try:
    urllib.request.urlopen('http://api.test:{origin.port}/missing')
except urllib.error.HTTPError as e:
    print('HTTPError', e.code)
try:
    urllib.request.urlopen('http://169.254.169.254/latest/meta-data/')
except PermissionError as e:
    print('denied', type(e).__name__)
"""
    r = sb.run(code)
    assert r.ok, r.error
    assert r.stdout.splitlines() == [
        "200 b'hello from the origin' yes",
        f"POST payload abc api.test:{origin.port}",
        "HTTPError 404",
        "denied CapabilityDenied",
    ]


def test_post_with_headers_and_body(sb: wasibox.Sandbox, origin: Server) -> None:
    value = sb.call(f"""\
import host
def f():
    r = host.http.request('POST', 'http://api.test:{origin.port}/echo',
                          headers={{'Content-Type': 'text/plain', 'Host': 'evil.example'}},
                          body='hé')
    return r.json()
""", "f")
    assert value["method"] == "POST" and value["body"] == "hé".encode().decode("latin-1")
    # The guest cannot choose the Host header: it always names the checked target.
    assert value["headers"]["host"] == f"api.test:{origin.port}"
    assert value["headers"]["accept-encoding"] == "gzip"


def test_error_statuses_are_responses(sb: wasibox.Sandbox, origin: Server) -> None:
    assert fetch(sb, f"http://api.test:{origin.port}/status?code=503").stdout == \
        "ok 503 b'status body'\n"


@pytest.mark.parametrize("url", [
    "http://API.TEST:{o}/hello", "http://api.test.:{o}/hello", "http://a.wild.test:{o}/hello",
    "http://bücher.test:{o}/hello", "http://xn--bcher-kva.test:{o}/hello",
    "http://ＡＰＩ.test:{o}/hello",  # full-width letters map to api.test (UTS 46)
])
def test_names_are_canonicalised(sb: wasibox.Sandbox, origin: Server, url: str) -> None:
    r = fetch(sb, url.format(o=origin.port))
    assert r.stdout == "ok 200 b'hello from the origin'\n"


def test_gzip_is_decoded(sb: wasibox.Sandbox, origin: Server) -> None:
    r = fetch(sb, f"http://api.test:{origin.port}/gzip")
    assert r.stdout == f"ok 200 {(b'squeezed ' * 100)[:200]!r}\n"


# -- SSRF vectors: all denied, the canary sees nothing ------------------------------------------

VECTORS = [
    # loopback, private and unspecified literals (all on the allowlist, to prove the IP check)
    "http://127.0.0.1:{c}/", "http://[::1]:{c}/", "http://0.0.0.0:{c}/",
    # IPv4 inside IPv6: mapped, compatible, NAT64, 6to4
    "http://[::ffff:127.0.0.1]:{c}/", "http://[::ffff:7f00:1]:{c}/", "http://[::127.0.0.1]:{c}/",
    "http://[64:ff9b::7f00:1]:{c}/", "http://[2002:7f00:1::1]:{c}/",
    "http://[0:0:0:0:0:ffff:127.0.0.1]:{c}/",
    # numeric spellings of 127.0.0.1
    "http://2130706433:{c}/", "http://0x7f000001:{c}/", "http://0177.0.0.1:{c}/",
    "http://127.1:{c}/", "http://0x7f.0.0.1:{c}/", "http://127.0.0.1.:{c}/",
    "http://127。0。0。1:{c}/",
    # cloud metadata, in every spelling
    "http://169.254.169.254/latest/meta-data/", "http://2852039166/", "http://0xa9fea9fe/",
    "http://0251.0376.0251.0376/", "http://169.254.43518/", "http://[::ffff:169.254.169.254]/",
    "http://[fd00:ec2::254]/", "http://100.100.100.200/", "http://[64:ff9b::a9fe:a9fe]/",
    "http://metadata.google.internal:{c}/",  # allowlisted and opted in to loopback: still no
    # allowlisted names that resolve inward
    "http://localhost:{c}/", "http://inward.test:{c}/", "http://private.test:{c}/",
    "http://mixed.test:{c}/",
    # the right name on a port that is not allowed
    "http://api.test:{c}/",
    # names not on the allowlist, or that only look like one
    "http://evil.test:{c}/", "http://wild.test:{o}/", "http://аpi.test:{o}/",
    "http://api.test.evil.test:{o}/",
    # parser confusion: userinfo, backslashes, whitespace and control characters
    "http://api.test:{o}@127.0.0.1:{c}/", "http://user:pw@api.test:{o}/hello",
    "http://127.0.0.1:{c}\\@api.test:{o}/", "http://api.test:{o}\\@127.0.0.1:{c}/",
    "http://api.test:{o}/hello\r\nHost: 127.0.0.1:{c}", "http://api.test:{o}/a b",
    "http://api.test:{o}/\x00", "http://api.test:{o}\t/hello", " http://api.test:{o}/hello",
    "http://[::1%25lo]:{c}/",
    # other schemes
    "ftp://api.test:{o}/", "file:///etc/passwd", "gopher://127.0.0.1:{c}/_GET",
    "https+unix://x/", "//api.test:{o}/hello", "api.test:{o}/hello",
]


@pytest.mark.parametrize("vector", VECTORS)
def test_ssrf_vector_is_denied_and_never_connects(sb: wasibox.Sandbox, origin: Server,
                                                  canary: Server, vector: str,
                                                  fds: int) -> None:
    before = origin.connections
    r = fetch(sb, vector.format(o=origin.port, c=canary.port))
    assert r.stdout == f"denied True {DENIED_MESSAGE}\n", r
    assert origin.connections == before
    (event,) = r.capability_log
    assert event.allowed is False and event.reason
    assert_unharmed(sb, canary, fds)


@pytest.mark.parametrize("headers", [
    {"X-Evil": "a\r\nHost: 127.0.0.1"}, {"X-Evil": "a\nb"}, {"X-Evil": "nul\x00"},
    {"Bad Name": "x"}, {"X:Y": "x"}, [["X-A"]], "not headers",
    {f"X-{i}": "v" for i in range(200)}, {"X-Big": "v" * 70_000},
])
def test_header_injection_is_denied(sb: wasibox.Sandbox, origin: Server, canary: Server,
                                    headers: Any, fds: int) -> None:
    before = origin.connections
    r = fetch(sb, f"http://api.test:{origin.port}/echo", headers=headers)
    assert r.stdout.startswith("denied True") or "ProtocolError" in r.stdout \
        or r.error is not None, r
    assert origin.connections == before
    assert_unharmed(sb, canary, fds)


def test_method_outside_the_policy_is_denied(sb: wasibox.Sandbox, origin: Server,
                                             canary: Server, fds: int) -> None:
    before = origin.connections
    for method in ("DELETE", "CONNECT", "GET /x HTTP/1.1\r\n", ""):
        r = fetch(sb, f"http://api.test:{origin.port}/hello", method=method)
        assert r.stdout == f"denied True {DENIED_MESSAGE}\n"
    assert origin.connections == before
    assert_unharmed(sb, canary, fds)


def test_http_not_granted_is_denied_with_the_same_message(origin: Server) -> None:
    with wasibox.Sandbox() as sandbox:
        r = fetch(sandbox, f"http://api.test:{origin.port}/hello")
        assert r.stdout == f"denied True {DENIED_MESSAGE}\n"
        # Refused from the name alone: its request is never decoded, so never logged.
        (event,) = r.capability_log
        assert (event.capability, event.target, event.allowed, event.reason) == (
            "http", "@http", False, "HTTP is not granted")


def test_ambient_proxy_settings_are_ignored(origin: Server, canary: Server,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{canary.port}")
    with wasibox.Sandbox(http=policy(origin, canary)) as sandbox:
        r = fetch(sandbox, f"http://api.test:{origin.port}/hello")
        assert r.stdout == "ok 200 b'hello from the origin'\n"
    assert canary.connections == 0


# -- DNS: resolved once, connected to the checked address ---------------------------------------

class Rebinding:
    """Answers loopback the first time, the metadata address after that."""

    def __init__(self) -> None:
        self.lookups = 0

    def __call__(self, name: str) -> list[str]:
        self.lookups += 1
        return ["127.0.0.1"] if self.lookups == 1 else ["169.254.169.254"]


def test_dns_rebinding_cannot_switch_the_connection(origin: Server, canary: Server,
                                                    fds: int) -> None:
    resolver = Rebinding()
    rebinding = wasibox.HttpPolicy(allow=[f"rebind.test:{origin.port}"], resolver=resolver,
                                   allow_loopback=["rebind.test"])
    with wasibox.Sandbox(http=rebinding) as sandbox:
        r = fetch(sandbox, f"http://rebind.test:{origin.port}/hello")
        assert r.stdout == "ok 200 b'hello from the origin'\n"
        assert resolver.lookups == 1  # resolved once; the connection used that answer
    resolver = Rebinding()
    rebinding = wasibox.HttpPolicy(allow=[f"rebind.test:{origin.port}"], resolver=resolver,
                                   allow_loopback=["rebind.test"])
    with wasibox.Sandbox(http=rebinding) as sandbox:
        # A redirect is a new hop: resolved and checked again, and now it points inward.
        r = fetch(sandbox, f"http://rebind.test:{origin.port}/redirect?to=/hello")
        assert r.stdout == f"denied True {DENIED_MESSAGE}\n"
        assert [e.allowed for e in r.capability_log] == [True, False]
        assert_unharmed(sandbox, canary, fds)


# -- https: the name travels in SNI and is what the certificate is checked against ---------------

@pytest.fixture(scope="module")
def tls_origin() -> Iterator[tuple[Server, trustme.CA, list[str]]]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.test").configure_cert(context)
    server_names: list[str] = []
    context.sni_callback = lambda sock, name, ctx: server_names.append(name)  # type: ignore[assignment,misc,arg-type]
    server = Server()
    server.socket = context.wrap_socket(server.socket, server_side=True)
    start(server)
    yield server, ca, server_names
    server.shutdown()
    server.server_close()


def test_https_connects_to_the_address_with_sni_and_certificate_for_the_name(
        tls_origin: tuple[Server, trustme.CA, list[str]], canary: Server, fds: int) -> None:
    server, ca, server_names = tls_origin
    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    names = Names({"api.test": ["127.0.0.1"], "impostor.test": ["127.0.0.1"]})
    tls = wasibox.HttpPolicy(allow=[f"api.test:{server.port}", f"impostor.test:{server.port}"],
                             resolver=names, allow_loopback=["api.test", "impostor.test"],
                             ssl_context=trust)
    with wasibox.Sandbox(http=tls) as sandbox:
        r = fetch(sandbox, f"https://api.test:{server.port}/hello")
        assert r.stdout == "ok 200 b'hello from the origin'\n"
        assert server_names == ["api.test"]
        # The same address under another name: the certificate does not match the name.
        r = fetch(sandbox, f"https://impostor.test:{server.port}/hello")
        assert r.stdout == "error True the request failed: could not connect\n"
        assert server_names == ["api.test", "impostor.test"]
        # Without the test CA, the default trust store refuses the test certificate.
        default = wasibox.HttpPolicy(allow=[f"api.test:{server.port}"], resolver=names,
                                     allow_loopback=["api.test"])
        with wasibox.Sandbox(http=default) as untrusting:
            r = fetch(untrusting, f"https://api.test:{server.port}/hello")
            assert r.stdout == "error True the request failed: could not connect\n"
        assert_unharmed(sandbox, canary, fds)


# -- redirects -----------------------------------------------------------------------------------

def test_redirect_chain_within_the_limit(sb: wasibox.Sandbox, origin: Server) -> None:
    r = fetch(sb, f"http://api.test:{origin.port}/chain/3")
    assert r.stdout == "ok 200 b'end of chain'\n"
    assert [e.allowed for e in r.capability_log] == [True] * 4
    assert r.capability_log[-1].target == f"http://api.test:{origin.port}/chain/0"


def test_redirect_chain_past_the_limit(sb: wasibox.Sandbox, origin: Server) -> None:
    r = fetch(sb, f"http://api.test:{origin.port}/chain/4")
    assert r.stdout == "error True more than 3 redirects\n"


@pytest.mark.parametrize("to", [
    "http://127.0.0.1:{c}/", "http://inward.test:{c}/", "http://[::ffff:127.0.0.1]:{c}/",
    "http://2130706433:{c}/", "file:///etc/passwd", "ftp://api.test:{o}/",
    "gopher://127.0.0.1:{c}/", "http://api.test:{o}@127.0.0.1:{c}/", "//127.0.0.1:{c}/",
    "http://169.254.169.254/", "/\\127.0.0.1:{c}/",
])
def test_redirect_inward_or_to_another_scheme_is_denied(sb: wasibox.Sandbox, origin: Server,
                                                        canary: Server, to: str,
                                                        fds: int) -> None:
    target = urllib.parse.quote(to.format(o=origin.port, c=canary.port), safe="")
    for code in (301, 302, 303, 307, 308):
        r = fetch(sb, f"http://api.test:{origin.port}/redirect?code={code}&to={target}")
        assert r.stdout == f"denied True {DENIED_MESSAGE}\n", r
        assert [e.allowed for e in r.capability_log] == [True, False]
    assert_unharmed(sb, canary, fds)


def test_credentials_are_dropped_across_origins(sb: wasibox.Sandbox, origin: Server) -> None:
    code = f"""\
import host, urllib.parse
def f(to):
    url = 'http://api.test:{origin.port}/redirect?code=307&to=' + urllib.parse.quote(to, safe='')
    return host.http.request('GET', url, headers={{'Authorization': 'Bearer s3cret',
                                                   'Cookie': 'a=b', 'X-Other': 'kept'}}).json()
"""
    same = sb.call(code, "f", f"http://api.test:{origin.port}/echo")["headers"]
    assert same["authorization"] == "Bearer s3cret" and same["cookie"] == "a=b"
    other = sb.call(code, "f", f"http://other.test:{origin.port}/echo")["headers"]
    assert "authorization" not in other and "cookie" not in other
    assert other["x-other"] == "kept" and other["host"] == f"other.test:{origin.port}"


def test_server_cookies_are_never_replayed(sb: wasibox.Sandbox, origin: Server) -> None:
    echo = sb.call(f"import host\ndef f():\n    return host.http.request('GET', "
                   f"'http://api.test:{origin.port}/set-cookie').json()", "f")
    assert "cookie" not in echo["headers"]


def test_303_turns_a_post_into_a_get(sb: wasibox.Sandbox, origin: Server) -> None:
    to = urllib.parse.quote("/echo", safe="")
    echo = sb.call(f"import host\ndef f():\n    return host.http.request('POST', "
                   f"'http://api.test:{origin.port}/redirect?code=303&to={to}', "
                   f"body=b'data').json()", "f")
    assert (echo["method"], echo["body"]) == ("GET", "")


# -- hostile responses ---------------------------------------------------------------------------

@pytest.mark.parametrize("path, message", [
    ("/gzip-bomb", "the response is larger than max_response_bytes (1048576)"),
    ("/big", "the response is larger than max_response_bytes (1048576)"),
    ("/many-headers", "the response's headers exceed the policy's caps"),
    ("/huge-header", "the server broke the protocol"),
    ("/brotli", "the response uses a content encoding other than gzip"),
])
def test_hostile_responses_are_clean_errors(sb: wasibox.Sandbox, origin: Server,
                                            canary: Server, path: str, message: str,
                                            fds: int) -> None:
    r = fetch(sb, f"http://api.test:{origin.port}{path}")
    assert r.stdout.startswith(f"error True {message}"), r
    (event,) = r.capability_log
    assert event.allowed is True and event.reason and event.bytes_received == 0
    assert_unharmed(sb, canary, fds)


def test_policy_timeout_is_a_clean_error(origin: Server, canary: Server, fds: int) -> None:
    with wasibox.Sandbox(http=policy(origin, canary, timeout_s=0.3)) as sandbox:
        r = fetch(sandbox, f"http://api.test:{origin.port}/slow?s=2")
        assert r.stdout == "error True the request timed out\n"
        assert_unharmed(sandbox, canary, fds)


def test_slow_server_still_ends_at_the_run_timeout(origin: Server, canary: Server,
                                                   fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(timeout_s=0.5),
                         http=policy(origin, canary, timeout_s=30)) as sandbox:
        r = fetch(sandbox, f"http://api.test:{origin.port}/slow?s=3")
        assert r.limit_exceeded is Limit.TIMEOUT
        assert r.duration_s < 30


def test_http_calls_count_against_the_host_call_limit(origin: Server, canary: Server) -> None:
    with wasibox.Sandbox(wasibox.Limits(host_calls=2), http=policy(origin, canary)) as sandbox:
        r = sandbox.run(f"import host\nfor _ in range(5):\n    host.http.request('GET', "
                        f"'http://api.test:{origin.port}/hello')")
        assert r.limit_exceeded is Limit.HOST_CALLS


# -- the policy itself, without a guest ----------------------------------------------------------

@pytest.mark.parametrize("entry", [
    "http://api.test", "api test", "2130706433", "0x7f000001", "*.", "api.test:99999",
    "user@api.test", "api.test/path", "", "api..test", "-api.test",
])
def test_bad_allow_entries_are_usage_errors(entry: str) -> None:
    with pytest.raises(wasibox.UsageError, match="allow"):
        wasibox.HttpPolicy(allow=[entry])


@pytest.mark.parametrize("changes", [
    {"allow": "api.test"}, {"methods": "GET"}, {"methods": ["G E T"]}, {"timeout_s": 0},
    {"timeout_s": float("inf")}, {"max_redirects": -1}, {"max_response_bytes": "lots"},
    {"resolver": 42}, {"allow_loopback": "api.test"},
])
def test_bad_policy_settings_are_usage_errors(changes: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"allow": ["api.test"], **changes}
    with pytest.raises(wasibox.UsageError):
        wasibox.HttpPolicy(**settings)
    with pytest.raises(wasibox.UsageError, match="HttpPolicy"):
        wasibox.Sandbox(http={"allow": ["api.test"]})  # type: ignore[arg-type]


def test_allowlist_matching() -> None:
    p = wasibox.HttpPolicy(allow=["api.example.com", "*.example.org:8443", "Bücher.example."])
    assert p.allows("https", "api.example.com", 443) and p.allows("http", "api.example.com", 80)
    assert not p.allows("https", "api.example.com", 8443)
    assert p.allows("https", "a.b.example.org", 8443)
    assert not p.allows("https", "example.org", 8443)
    assert not p.allows("https", "a.example.org", 443)
    assert p.allows("https", "xn--bcher-kva.example", 443)


@pytest.mark.parametrize("address, allowed", [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("100.100.100.200", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("255.255.255.255", False), ("240.0.0.1", False),
    ("198.18.0.1", False), ("192.0.2.1", False), ("::", False), ("::1", False),
    ("fe80::1", False), ("fc00::1", False), ("fd00:ec2::254", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("::127.0.0.1", False),
    ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::7f00:1", False), ("2002:a9fe:a9fe::", False),
    ("2002:0a00:0001::1", False), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),
    ("168.63.129.16", False),
])
def test_address_checks(address: str, allowed: bool) -> None:
    import ipaddress

    assert address_allowed(ipaddress.ip_address(address)) is allowed


def test_loopback_opt_in_covers_only_loopback() -> None:
    import ipaddress

    assert address_allowed(ipaddress.ip_address("127.0.0.1"), loopback_ok=True)
    assert address_allowed(ipaddress.ip_address("::1"), loopback_ok=True)
    for address in ("10.0.0.1", "169.254.169.254", "::ffff:127.0.0.1", "0.0.0.0"):
        assert not address_allowed(ipaddress.ip_address(address), loopback_ok=True)


def test_url_is_parsed_once_into_canonical_parts() -> None:
    target = parse_url("HTTP://Bücher.Example.:8080/p/ä?q=1#frag")
    assert (target.scheme, target.host, target.port) == ("http", "xn--bcher-kva.example", 8080)
    assert target.path == "/p/%C3%A4?q=1"
    assert target.url == "http://xn--bcher-kva.example:8080/p/%C3%A4?q=1"


# -- opted-in loopback endpoints -----------------------------------------------------------------

def test_loopback_endpoint_opt_in_allows_exactly_that_host_and_port(
        origin: Server, canary: Server, fds: int) -> None:
    o, c = origin.port, canary.port
    opted = wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[f"127.0.0.1:{o}"])
    with wasibox.Sandbox(http=opted) as sandbox:
        r = fetch(sandbox, f"http://127.0.0.1:{o}/hello")
        assert r.stdout == "ok 200 b'hello from the origin'\n"
        assert [(e.target, e.allowed) for e in r.capability_log] == [
            (f"http://127.0.0.1:{o}/hello", True)]
        # Another port on loopback, and the same port under another loopback spelling, are
        # still denied.
        for url in (f"http://127.0.0.1:{c}/hello", f"http://[::1]:{o}/hello",
                    f"http://127.0.0.2:{o}/hello", f"http://localhost:{o}/hello"):
            assert fetch(sandbox, url).stdout == f"denied True {DENIED_MESSAGE}\n", url
        assert_unharmed(sandbox, canary, fds)
    # Without the opt-in, the same request is denied like any loopback address.
    plain = wasibox.HttpPolicy(allow=[f"127.0.0.1:{o}"])
    with wasibox.Sandbox(http=plain) as sandbox:
        r = fetch(sandbox, f"http://127.0.0.1:{o}/hello")
        assert r.stdout == f"denied True {DENIED_MESSAGE}\n"
        (event,) = r.capability_log
        assert not event.allowed and "denied address" in event.reason


def test_loopback_endpoint_by_name_must_resolve_to_loopback(origin: Server) -> None:
    o = origin.port
    for answers, expected in ((["127.0.0.1"], "ok 200 b'hello from the origin'\n"),
                              (["127.0.0.1", "10.0.0.1"], f"denied True {DENIED_MESSAGE}\n"),
                              (["169.254.169.254"], f"denied True {DENIED_MESSAGE}\n")):
        opted = wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[f"localhost:{o}"],
                                   resolver=Names({"localhost": answers}))
        with wasibox.Sandbox(http=opted) as sandbox:
            assert fetch(sandbox, f"http://localhost:{o}/hello").stdout == expected, answers


@pytest.mark.parametrize("entry", [
    "127.0.0.1", "localhost", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.0/8:80",
    "10.0.0.1:80", "169.254.169.254:80", "example.com:80", "*.localhost:80", "*:80",
    "[::ffff:127.0.0.1]:80", "0.0.0.0:80", "localhost:80/path", "user@127.0.0.1:80",
    "2130706433:80", "",
])
def test_bad_loopback_endpoints_are_usage_errors(entry: str) -> None:
    with pytest.raises(wasibox.UsageError, match="allow_loopback_endpoints"):
        wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[entry])
    with pytest.raises(wasibox.UsageError, match="allow_loopback_endpoints"):
        wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=entry)  # a string, not a list
