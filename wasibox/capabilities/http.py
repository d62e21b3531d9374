"""Mediated HTTP: the only way a guest reaches the network, decided request by request.

**Threat: server-side request forgery (SSRF) and exfiltration.** The host sits inside a
network the guest must not see: loopback services, private ranges, cloud metadata endpoints
that hand out credentials. Guest code chooses every URL, header and body, and may try to
smuggle a request past the policy with a URL that two parsers read differently (userinfo,
backslashes, control characters, IDN look-alikes, numeric IPv4 spellings, IPv4 inside IPv6),
with an allowlisted name whose DNS answer points inward (or changes between check and
connect), with a redirect, or with a response built to exhaust the host (a gzip bomb,
endless or huge headers, a slow drip). The controls, modelled on pydantic-ai's ``_ssrf``:

* deny by default: only ``http``/``https`` on ``host:port`` pairs the ``HttpPolicy`` lists;
* the URL is parsed **once** and the request is built from that parse; URLs with userinfo,
  backslashes, whitespace or control characters are refused; host names are canonicalised
  (case, trailing dot, IDNA) and a host that looks numeric must be a canonical dotted quad;
* the name is resolved once and **every** address is checked (IPv4 embedded in IPv6 is
  unwrapped first): no loopback, private, link-local, CGNAT, multicast, reserved,
  documentation or unspecified address, and never a cloud metadata endpoint. The connection
  goes to the checked address, with Host and SNI from the name, so DNS rebinding cannot move
  it; each redirect hop is checked the same way, and credentials are dropped across origins;
* the decoded body, the header count and size, and the total time are capped; no ambient
  proxy, ``.netrc``, cookie jar or environment is consulted (httpx's transport, used
  directly, with ``trust_env=False``).

Every refusal reaches the guest with the same message (``hostcall.DENIED_MESSAGE``), which
never says whether the target exists or what it resolved to; the reason goes only into the
run's ``capability_log``. httpx is imported on first use, so runs without HTTP never pay
for it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

from .._errors import UsageError
from .._events import CapabilityEvent
from .._limits import parse_size
from .hostcall import DENIED_MESSAGE, CallRefused

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpGate", "HttpPolicy", "address_allowed", "parse_url"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Denied however they are reached. `ipaddress`'s is_private/is_global miss some of these
# (CGNAT is neither private nor global; is_global changed between Python versions), so the
# ranges are listed explicitly and is_global is only a second net.
_DENIED_NETWORKS: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = tuple(
    ipaddress.ip_network(cidr) for cidr in (
        "0.0.0.0/8",  # "this" network; 0.0.0.0 reaches the local host on Linux
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # CGNAT (RFC 6598); holds Alibaba Cloud's metadata address
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local; holds the AWS/GCP/Azure metadata address
        "172.16.0.0/12",  # private (RFC 1918)
        "192.0.0.0/24",  # IETF protocol assignments (RFC 6890)
        "192.0.2.0/24",  # documentation TEST-NET-1 (RFC 5737)
        "192.88.99.0/24",  # deprecated 6to4 relay anycast (RFC 7526)
        "192.168.0.0/16",  # private (RFC 1918)
        "198.18.0.0/15",  # benchmarking (RFC 2544)
        "198.51.100.0/24",  # documentation TEST-NET-2
        "203.0.113.0/24",  # documentation TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address
        "::/128",  # unspecified
        "::1/128",  # loopback
        "::ffff:0:0/96",  # IPv4-mapped: checked through the embedded IPv4 as well
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215)
        "100::/64",  # discard-only (RFC 6666)
        "2001::/32",  # Teredo: carries an obfuscated IPv4 that cannot be checked
        "2001:db8::/32",  # documentation (RFC 3849)
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # deprecated site-local
        "ff00::/8",  # multicast
    ))
_LOOPBACK_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# Cloud metadata and credential endpoints: denied even for a name allowed to reach loopback.
_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(address) for address in (
    "169.254.169.254",  # AWS, GCP, Azure, OCI, DigitalOcean, OpenStack
    "169.254.170.2",  # AWS ECS task credentials
    "169.254.170.23",  # AWS EKS pod identity
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure WireServer (a public address)
    "192.0.0.192",  # Oracle Cloud Classic
    "fd00:ec2::254",  # AWS IPv6
    "fd00:ec2::23",  # AWS EKS pod identity, IPv6
    "fd20:ce::254",  # GCP IPv6
))
_METADATA_NAMES = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data",
    "instance-data.ec2.internal", "metadata.azure.internal",
})
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_MAX_URL_CHARS = 8192
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Never forwarded from the guest: the host sets or forbids them (framing, hop-by-hop,
# proxies, and the encodings the host can decode under a cap).
_DROPPED_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
    "te", "trailer", "expect", "proxy-authorization", "proxy-connection", "accept-encoding",
})
_CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
_CHUNK = 64 * 1024


_default_tls: ssl.SSLContext | None = None


def _is_ssl_context(value: object) -> bool:
    import ssl  # here, not at the top: most runs never use HTTPS, and ssl is slow to import

    return isinstance(value, ssl.SSLContext)


_default_tls_lock = threading.Lock()


def _default_resolver(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclasses.dataclass(frozen=True)
class _Rule:
    host: str
    wildcard: bool
    port: int | None

    def matches(self, host: str, port: int, default_port: int) -> bool:
        if self.port is None and port != default_port:
            return False
        if self.port is not None and port != self.port:
            return False
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpPolicy:
    """What the guest may fetch over HTTP; everything else is denied.

    ``allow`` lists ``host`` or ``host:port`` entries; ``*.example.org`` matches subdomains
    (not ``example.org`` itself). An entry without a port allows only the scheme's default
    port (80 for http, 443 for https). Names are compared after canonicalisation (case,
    trailing dot, IDNA). Even an allowed name is refused if any address it resolves to is
    internal (loopback, private, link-local, metadata, ...).

    ``methods`` are the HTTP methods allowed. ``max_response_bytes`` caps the decoded body,
    ``max_header_count`` and ``max_header_bytes`` the response's headers (and the guest's),
    ``timeout_s`` the whole request including redirects, and ``max_redirects`` the hops
    followed, each one checked like the first.

    ``ssl_context`` verifies https servers (default: httpx's, with certifi's CA bundle); the
    certificate is always checked against the *name* in the URL, never the address.

    ``allow_loopback_endpoints`` opts in exact services on this machine, each a
    ``host:port`` whose host is a loopback address (``127.0.0.1``, ``[::1]``) or
    ``localhost``: requests to exactly that host and port are allowed (they need no ``allow``
    entry), every other loopback port stays denied, and no range or wildcard is accepted.

    For tests only: ``resolver`` replaces DNS (a callable from a name to address strings),
    and ``allow_loopback`` names allowlisted *names* that may resolve to loopback (literal
    loopback addresses stay denied).

    Raises UsageError for an entry or setting that cannot be understood.
    """

    allow: Sequence[str]
    methods: Sequence[str] = ("GET", "HEAD")
    max_response_bytes: int = 10 * 2**20
    timeout_s: float = 10.0
    max_redirects: int = 3
    max_header_count: int = 100
    max_header_bytes: int = 64 * 2**10
    resolver: Callable[[str], Sequence[str]] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    allow_loopback: Sequence[str] = ()
    allow_loopback_endpoints: Sequence[str] = ()
    ssl_context: ssl.SSLContext | None = dataclasses.field(default=None, repr=False,
                                                           compare=False)
    _rules: tuple[_Rule, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _endpoints: frozenset[tuple[str, int]] = dataclasses.field(init=False, repr=False,
                                                               compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.allow, str) or not isinstance(self.allow, Sequence):
            raise UsageError("HttpPolicy.allow must be a list of 'host' or 'host:port' entries")
        rules = tuple(_parse_rule(entry) for entry in self.allow)
        object.__setattr__(self, "allow", tuple(self.allow))
        object.__setattr__(self, "_rules", rules)
        if isinstance(self.methods, str) or not all(
                isinstance(method, str) and _TOKEN.match(method) for method in self.methods):
            raise UsageError(f"HttpPolicy.methods must be a list of HTTP methods such as "
                             f"('GET', 'POST'), not {self.methods!r}")
        object.__setattr__(self, "methods", tuple(method.upper() for method in self.methods))
        for name in ("max_response_bytes", "max_header_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        timeout = self.timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not math.isfinite(timeout) or timeout <= 0):
            raise UsageError(f"HttpPolicy.timeout_s must be a positive number, not {timeout!r}")
        object.__setattr__(self, "timeout_s", float(timeout))
        for name in ("max_redirects", "max_header_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"HttpPolicy.{name} must be a non-negative int, not {value!r}")
        if self.resolver is not None and not callable(self.resolver):
            raise UsageError("HttpPolicy.resolver must be a callable from a name to addresses")
        if self.ssl_context is not None and not _is_ssl_context(self.ssl_context):
            raise UsageError("HttpPolicy.ssl_context must be an ssl.SSLContext")
        if isinstance(self.allow_loopback, str):
            raise UsageError("HttpPolicy.allow_loopback must be a list of names")
        object.__setattr__(self, "allow_loopback",
                           tuple(_canonical_name(name) for name in self.allow_loopback))
        if isinstance(self.allow_loopback_endpoints, str):
            raise UsageError("HttpPolicy.allow_loopback_endpoints must be a list of "
                             "'host:port' entries")
        object.__setattr__(self, "allow_loopback_endpoints", tuple(self.allow_loopback_endpoints))
        object.__setattr__(self, "_endpoints", frozenset(
            _parse_loopback_endpoint(entry) for entry in self.allow_loopback_endpoints))

    def allows_loopback_endpoint(self, host: str, port: int) -> bool:
        """Whether ``host:port`` (canonical) is an opted-in loopback endpoint."""
        return (host, port) in self._endpoints

    def allows(self, scheme: str, host: str, port: int) -> bool:
        """Whether ``host:port`` (canonical) is on the allowlist for ``scheme``."""
        default_port = 443 if scheme == "https" else 80
        return any(rule.matches(host, port, default_port) for rule in self._rules)


def _parse_rule(entry: object) -> _Rule:
    if not isinstance(entry, str) or not entry:
        raise UsageError(f"an HttpPolicy.allow entry must be 'host' or 'host:port', not {entry!r}")
    try:
        parts = urllib.parse.urlsplit("//" + entry)
        port = parts.port
        raw_host = parts.hostname or ""
        if parts.username is not None or parts.path or parts.query or parts.fragment:
            raise ValueError(entry)
        wildcard = raw_host.startswith("*.")
        host = _canonical_host(raw_host[2:] if wildcard else raw_host)
    except (ValueError, _Denied):
        raise UsageError(f"cannot understand the HttpPolicy.allow entry {entry!r}: use "
                         "'host', 'host:port', '*.domain' or '*.domain:port'") from None
    return _Rule(host, wildcard, port)


def _parse_loopback_endpoint(entry: object) -> tuple[str, int]:
    """``(host, port)`` of an ``allow_loopback_endpoints`` entry. Raises UsageError."""
    problem = (f"cannot use the HttpPolicy.allow_loopback_endpoints entry {entry!r}: give one "
               "exact 'host:port' whose host is a loopback address (127.0.0.1, [::1]) or "
               "localhost, such as '127.0.0.1:8080'")
    if not isinstance(entry, str) or not entry:
        raise UsageError(problem)
    try:
        parts = urllib.parse.urlsplit("//" + entry)
        port = parts.port
        host = _canonical_host(parts.hostname or "")
        if parts.username is not None or parts.path or parts.query or parts.fragment:
            raise ValueError(entry)
    except (ValueError, _Denied):
        raise UsageError(problem) from None
    if port is None or port == 0:
        raise UsageError(problem)
    address = _ip_literal(host)
    if host != "localhost" and not (
            address is not None and any(address in network for network in _LOOPBACK_NETWORKS)):
        raise UsageError(problem)
    return host, port


class _Denied(Exception):
    """A request the policy refuses; the reason is for the log only."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One parsed, canonical URL: every later step uses these fields, never the text."""

    scheme: str
    host: str  # canonical name, or an IP address in its compressed form
    port: int
    path: str  # path and query, percent-encoded ASCII
    address: IPAddress | None  # set when the host is an IP literal

    @property
    def origin(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port

    @property
    def netloc(self) -> str:
        """``host[:port]`` as the Host header carries it (the port only if not the default)."""
        host = f"[{self.host}]" if isinstance(self.address, ipaddress.IPv6Address) else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.path}"


def parse_url(url: object) -> Target:
    """Parse ``url`` once into a canonical Target; raise _Denied for anything ambiguous."""
    if not isinstance(url, str) or not url or len(url) > _MAX_URL_CHARS:
        raise _Denied("not a URL of acceptable length")
    if "\\" in url:
        raise _Denied("backslash in URL")
    if any(ord(char) <= 0x20 or ord(char) == 0x7F or char.isspace()
           or not char.isprintable() for char in url):
        raise _Denied("whitespace or control character in URL")
    try:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise _Denied(f"scheme {scheme!r} is not http or https")
        if "@" in parts.netloc:
            raise _Denied("userinfo in URL")
        port = parts.port or (443 if scheme == "https" else 80)
        raw_host = parts.hostname
    except ValueError:
        raise _Denied("malformed URL") from None
    if not raw_host:
        raise _Denied("no host in URL")
    host = _canonical_host(raw_host)
    address = _ip_literal(host)
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    # Non-ASCII in the path or query is percent-encoded; existing escapes are kept as they are.
    path = urllib.parse.quote(path, safe="/?&=%:@!$'()*+,;-._~[]")
    return Target(scheme, host, port, path, address)


def _canonical_name(name: str) -> str:
    try:
        return _canonical_host(name)
    except _Denied:
        raise UsageError(f"{name!r} is not a host name") from None


def _canonical_host(raw: str) -> str:
    """Lower case, no trailing dot, IDNA (ASCII) form; IP literals in compressed form."""
    host = raw.lower()
    if ":" in host:  # an IPv6 literal (urlsplit removed the brackets)
        if "%" in host:
            raise _Denied("IPv6 zone identifier in URL")
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            raise _Denied("malformed IPv6 literal") from None
    if host.endswith("."):
        host = host[:-1]
    if not host.isascii():
        import idna

        try:
            host = idna.encode(host, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError):
            raise _Denied("host name is not valid IDNA") from None
    labels = host.split(".")
    if not all(_LABEL.match(label) for label in labels):
        raise _Denied("malformed host name")
    if _NUMERIC_LABEL.match(labels[-1]):
        # Looks like IPv4. Only the canonical dotted quad is accepted: 2852039166,
        # 0xa9fea9fe, 0251.0376.0251.0376 and 169.254.43518 all mean 169.254.169.254 to
        # some resolver, and none of them is a name.
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise _Denied("non-canonical numeric host") from None
    for label in labels:
        if label.startswith("xn--"):
            import idna

            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                raise _Denied("invalid punycode label") from None
    return host


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address may carry: mapped, compatible, 6to4, NAT64."""
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    compatible = int(address) >> 32 == 0 and not (address.is_loopback or address.is_unspecified)
    if address in _NAT64_WELL_KNOWN or compatible:  # NAT64, or IPv4-compatible (::a.b.c.d)
        found.append(low32)
    return found


def address_allowed(address: IPAddress, *, loopback_ok: bool = False) -> bool:
    """Whether the guest may connect to ``address`` (IPv4 inside IPv6 is unwrapped first)."""
    candidates: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        candidates.extend(_embedded_ipv4(address))
    for candidate in candidates:
        if candidate in _METADATA_ADDRESSES:
            return False
        if loopback_ok and candidate is address and any(
                candidate in network for network in _LOOPBACK_NETWORKS):
            continue
        if any(candidate in network for network in _DENIED_NETWORKS):
            return False
        if not candidate.is_global or candidate.is_multicast or candidate.is_reserved:
            return False
    return True


class _Failed(Exception):
    """An allowed request that did not complete; the message is safe to show the guest."""


class HttpGate:
    """Makes the guest's HTTP requests under one ``HttpPolicy``; one per run.

    Called by the host-call channel (``capabilities/hostcall.py``) on a worker thread, with the
    guest's request, the run's deadline and the run's capability log.
    """

    def __init__(self, policy: HttpPolicy) -> None:
        self.policy = policy
        self._resolve = policy.resolver or _default_resolver

    def _tls(self) -> ssl.SSLContext:
        """The TLS context: the policy's, or httpx's default, made once per process."""
        if self.policy.ssl_context is not None:
            return self.policy.ssl_context
        global _default_tls
        with _default_tls_lock:
            if _default_tls is None:
                import httpx

                # trust_env=False: SSL_CERT_FILE and friends are ambient configuration too.
                _default_tls = httpx.create_ssl_context(trust_env=False)
            return _default_tls

    def __call__(self, request: dict[str, Any], deadline: float,
                 log: list[CapabilityEvent]) -> dict[str, Any]:
        """Make one request (following redirects); return the response for the guest.

        Raises CallRefused: ``denied`` for anything the policy refuses, ``http`` for a
        request that was allowed but failed, ``invalid`` for a malformed request.
        """
        policy = self.policy
        method, url, headers, body = _request_fields(request)
        deadline = min(deadline, time.monotonic() + policy.timeout_s)
        started = time.perf_counter()
        current_url: object = url
        try:
            if not isinstance(method, str) or method.upper() not in policy.methods:
                raise _Denied(f"method {method!r} is not allowed")
            method = method.upper()
            headers = self._guest_headers(headers)
        except _Denied as exc:
            log.append(_event(method, url, False, 0, 0, started, str(exc)))
            raise CallRefused("denied", "CapabilityDenied", DENIED_MESSAGE, str(exc)) from None
        import httpx

        timeout = request.get("timeout")
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
            deadline = min(deadline, time.monotonic() + timeout)
        transport = httpx.HTTPTransport(verify=self._tls(), trust_env=False, retries=0,
                                        http1=True, http2=False)
        with transport:
            for _hop in range(policy.max_redirects + 1):
                hop_started = time.perf_counter()
                try:
                    if method not in policy.methods:  # a redirect may have changed it
                        raise _Denied(f"method {method!r} is not allowed")
                    target = parse_url(current_url)
                    addresses = self._check(target)
                except _Denied as exc:
                    log.append(_event(method, current_url, False, len(body or b""), 0,
                                      hop_started, str(exc)))
                    raise CallRefused("denied", "CapabilityDenied", DENIED_MESSAGE,
                                      str(exc)) from None
                try:
                    reply = self._send(transport, method, target, addresses[0], headers,
                                       body, deadline)
                except _Failed as exc:
                    log.append(_event(method, target.url, True, len(body or b""), 0,
                                      hop_started, str(exc)))
                    raise CallRefused("http", "HttpError", str(exc), str(exc)) from None
                log.append(_event(method, target.url, True, len(body or b""),
                                  len(reply["body"]), hop_started,
                                  f"status {reply['status']}"))
                location = reply.pop("location")
                if location is None:
                    return reply
                next_url = urllib.parse.urljoin(target.url, location)
                if reply["status"] == 303 or (reply["status"] in (301, 302)
                                              and method == "POST"):
                    method, body = ("HEAD" if method == "HEAD" else "GET"), None
                    headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
                try:
                    same_origin = parse_url(next_url).origin == target.origin
                except _Denied:
                    same_origin = False
                if not same_origin:
                    headers = [(k, v) for k, v in headers
                               if k.lower() not in _CREDENTIAL_HEADERS]
                current_url = next_url
            message = f"more than {policy.max_redirects} redirects"
            raise CallRefused("http", "HttpError", message, message)

    # -- the steps of one hop ----------------------------------------------------------------

    def _check(self, target: Target) -> list[IPAddress]:
        """The addresses to connect to, all checked; raise _Denied otherwise."""
        policy = self.policy
        if target.host in _METADATA_NAMES or target.host.endswith(".internal"):
            raise _Denied("cloud metadata name")
        # An opted-in loopback endpoint: this exact host and port may reach loopback.
        endpoint = policy.allows_loopback_endpoint(target.host, target.port)
        if not endpoint and not policy.allows(target.scheme, target.host, target.port):
            raise _Denied("not on the allowlist")
        if target.address is not None:
            addresses: list[IPAddress] = [target.address]
            # Only an opted-in endpoint (never a name from `allow_loopback`) may be a literal.
            loopback_ok = endpoint
        else:
            try:
                answers = list(self._resolve(target.host))
            except (OSError, UnicodeError, ValueError) as exc:
                raise _Denied(f"name did not resolve ({type(exc).__name__})") from None
            addresses = []
            for answer in answers:
                try:
                    addresses.append(ipaddress.ip_address(str(answer).split("%", 1)[0]))
                except ValueError:
                    raise _Denied("resolver returned something that is not an address") from None
            if not addresses:
                raise _Denied("name did not resolve")
            loopback_ok = endpoint or target.host in policy.allow_loopback
        for address in addresses:
            if not address_allowed(address, loopback_ok=loopback_ok):
                raise _Denied(f"resolves to a denied address ({address})")
        return addresses

    def _guest_headers(self, headers: object) -> list[tuple[str, str]]:
        policy = self.policy
        if headers is None:
            return []
        if not isinstance(headers, list):
            raise _Denied("headers are not a list of pairs")
        kept: list[tuple[str, str]] = []
        total = 0
        for pair in headers:
            if (not isinstance(pair, list | tuple) or len(pair) != 2
                    or not all(isinstance(part, str) for part in pair)):
                raise _Denied("a header is not a (name, value) pair of strings")
            name, value = pair
            if not _TOKEN.match(name):
                raise _Denied("malformed header name")
            if any(ord(char) < 0x20 and char != "\t" or ord(char) == 0x7F
                   or ord(char) > 0xFF for char in value):
                raise _Denied("control character or non-latin-1 text in a header value")
            total += len(name) + len(value) + 4
            if name.lower() not in _DROPPED_HEADERS:
                kept.append((name, value))
        if len(headers) > policy.max_header_count or total > policy.max_header_bytes:
            raise _Denied("too many or too large request headers")
        return kept

    def _send(self, transport: httpx.HTTPTransport, method: str, target: Target,
              address: IPAddress, headers: list[tuple[str, str]], body: bytes | None,
              deadline: float) -> dict[str, Any]:
        import httpx

        policy = self.policy
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Failed("the request timed out")
        sent: list[tuple[str, str]] = [("Host", target.netloc), ("Accept-Encoding", "gzip"),
                                       *headers]
        if not any(k.lower() == "user-agent" for k, _ in headers):
            sent.append(("User-Agent", "wasibox"))
        extensions: dict[str, Any] = {"timeout": dict.fromkeys(
            ("connect", "read", "write", "pool"), remaining)}
        if target.scheme == "https":
            extensions["sni_hostname"] = target.host
        # The connection goes to the checked address; the name only travels in Host and SNI.
        url = httpx.URL(scheme=target.scheme, host=str(address), port=target.port,
                        raw_path=target.path.encode("ascii"))
        request = httpx.Request(method, url, headers=[(k.encode("latin-1"), v.encode("latin-1"))
                                                      for k, v in sent],
                                content=body, extensions=extensions)
        try:
            response = transport.handle_request(request)
        except httpx.TimeoutException:
            raise _Failed("the request timed out") from None
        except httpx.ConnectError:
            raise _Failed("the request failed: could not connect") from None
        except httpx.HTTPError:
            raise _Failed("the server broke the protocol") from None
        try:
            raw_headers = response.headers.raw
            if (len(raw_headers) > policy.max_header_count
                    or sum(len(k) + len(v) + 4 for k, v in raw_headers) > policy.max_header_bytes):
                raise _Failed("the response's headers exceed the policy's caps")
            location = response.headers.get("location") if response.status_code in _REDIRECTS \
                else None
            content = b"" if location is not None else self._read_body(response, deadline)
        except httpx.TimeoutException:
            raise _Failed("the request timed out") from None
        except httpx.HTTPError:
            raise _Failed("the server broke the protocol while sending its response") from None
        finally:
            response.close()
        reason = response.extensions.get("reason_phrase", b"")
        header_pairs = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in raw_headers
                        if k.lower() not in (b"content-encoding", b"content-length",
                                             b"transfer-encoding")]
        return {"status": response.status_code,
                "reason": reason.decode("latin-1") if isinstance(reason, bytes) else "",
                "headers": header_pairs, "body": content, "url": target.url,
                "location": location}

    def _read_body(self, response: httpx.Response, deadline: float) -> bytes:
        """The decoded body, capped while it is decoded: a gzip bomb stops at the cap."""
        cap = self.policy.max_response_bytes
        codings = [part.strip().lower() for value in response.headers.get_list("content-encoding")
                   for part in value.split(",") if part.strip().lower() not in ("", "identity")]
        if codings not in ([], ["gzip"], ["x-gzip"]):
            raise _Failed("the response uses a content encoding other than gzip")
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if codings else None
        out = bytearray()
        raw_total = 0
        for chunk in _raw_chunks(response):
            raw_total += len(chunk)
            if raw_total > cap:
                raise _Failed(f"the response is larger than max_response_bytes ({cap})")
            if time.monotonic() > deadline:
                raise _Failed("the request timed out")
            if decoder is None:
                out += chunk
            else:
                data = chunk
                while data:
                    try:
                        out += decoder.decompress(data, cap + 1 - len(out))
                    except zlib.error:
                        raise _Failed("the response's gzip data is corrupt") from None
                    if len(out) > cap:
                        break
                    data = decoder.unconsumed_tail
                    if decoder.eof:  # a second gzip member may follow
                        data = decoder.unused_data + data
                        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if data else decoder
            if len(out) > cap:
                raise _Failed(f"the response is larger than max_response_bytes ({cap})")
        return bytes(out)


def _raw_chunks(response: httpx.Response) -> Iterator[bytes]:
    stream: Any = response.stream
    yield from stream


def _request_fields(request: dict[str, Any]) -> tuple[object, object, object, bytes | None]:
    body = request.get("body")
    if body is not None and not isinstance(body, bytes):
        raise CallRefused("invalid", "ProtocolError", "the call's payload is malformed",
                          "HTTP body is not bytes")
    return request.get("method"), request.get("url"), request.get("headers"), body


def _event(method: object, url: object, allowed: bool, sent: int, received: int,
           started: float, reason: str) -> CapabilityEvent:
    target = url if isinstance(url, str) else repr(url)
    if not target.isprintable():
        target = target.encode("unicode_escape").decode("ascii")
    return CapabilityEvent(capability="http", action=str(method)[:16], target=target[:2000],
                           allowed=allowed, bytes_sent=sent, bytes_received=received,
                           duration_s=time.perf_counter() - started, reason=reason)
