"""HTTP for the guest, mediated by the host: ``host.http.request`` and ``urllib.request``.

The guest has no sockets and no ssl module. Every request, including each redirect, is
decided and made by the host under the sandbox's HTTP policy; this module only carries it.
``install()`` (called once when the runner is snapshotted) makes ``urllib.request.urlopen``
use the same path, so code written for urllib works unchanged.
"""

import email.message
import io
import json
import urllib.error
import urllib.request
import urllib.response

import host

__all__ = ["Response", "install", "request"]


class Response:
    """What the host fetched: ``status``, ``reason``, ``headers`` (name, value pairs),
    ``body`` (bytes) and ``url`` (after redirects)."""

    def __init__(self, status, reason, headers, body, url):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.url = url

    def header(self, name, default=None):
        """The first header called ``name`` (case-insensitive), or ``default``."""
        wanted = name.lower()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return default

    def text(self, encoding="utf-8"):
        return self.body.decode(encoding)

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<host.http.Response {self.status} {self.url}>"


def request(method, url, headers=None, body=None, timeout=None):
    """Ask the host to make one HTTP request; redirects are followed (and checked) by it.

    Raises ``host.CapabilityDenied`` if the policy does not allow it, and ``host.HttpError``
    if it was allowed but failed. A 4xx or 5xx status is a normal ``Response``.
    """
    if isinstance(headers, dict):
        headers = list(headers.items())
    if isinstance(body, str):
        body = body.encode("utf-8")
    reply = host._invoke(host.HTTP_FUNCTION, (), {
        "method": method, "url": url, "headers": [list(pair) for pair in headers or ()],
        "body": bytes(body) if body is not None else None, "timeout": timeout,
    })
    return Response(reply["status"], reply["reason"], [tuple(pair) for pair in reply["headers"]],
                    reply["body"], reply["url"])


def _read_body(data):
    if data is None or isinstance(data, bytes | bytearray | memoryview):
        return data
    if hasattr(data, "read"):
        return data.read()
    return b"".join(data)


class _HostHandler(urllib.request.HTTPHandler):
    """Serves http and https URLs for urllib through the host, and sends ftp there too (where
    the policy refuses it), ahead of urllib's own handlers."""

    handler_order = 100

    def http_open(self, req):
        timeout = req.timeout if isinstance(req.timeout, int | float) else None
        reply = request(req.get_method(), req.full_url, headers=req.header_items(),
                        body=_read_body(req.data), timeout=timeout)
        message = email.message.Message()
        for key, value in reply.headers:
            message[key] = value
        response = urllib.response.addinfourl(io.BytesIO(reply.body), message, reply.url,
                                              reply.status)
        response.msg = reply.reason
        response.reason = reply.reason
        return response

    https_open = ftp_open = http_open
    https_request = urllib.request.HTTPHandler.http_request


def install():
    """Route urllib.request.urlopen through the host (no proxies, no local files)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _HostHandler())
    urllib.request.install_opener(opener)
