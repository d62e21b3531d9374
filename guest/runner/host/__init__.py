"""What the host grants this sandbox: its named functions, and mediated HTTP.

Inside the sandbox::

    import host
    host.lookup(42)                  # calls the host function "lookup"
    host.call("lookup", 42)          # the same, for names that are not identifiers
    host.http.request("GET", "https://api.example.com/v1/items")

Every call crosses to the host through one channel (guest/wit/host.wit): the host
checks the name, the size and the shape of the payload, and the call limits, then answers.

Exceptions:

* ``CapabilityDenied`` (a ``PermissionError``): the host refused, because the name is not
  granted or the HTTP policy does not allow the request. The message is always the same.
* ``HostError``: the host function raised; ``.type`` and ``.message`` describe it.
* ``HttpError`` (an ``OSError``): an allowed HTTP request failed (connection, timeout, a
  response over the size cap, too many redirects).

This module is part of the guest runner: it runs inside the sandbox and never imports the
host package.
"""

import msgpack
from wit_world.imports import host as _channel
from componentize_py_types import Err as _Err

__all__ = ["CapabilityDenied", "HostError", "HttpError", "call", "http"]

#: The name the built-in HTTP client is reached by (not an identifier, so it cannot clash
#: with a registered function).
HTTP_FUNCTION = "@http"


class CapabilityDenied(PermissionError):
    """The host does not grant this: the function is unknown or the request is not allowed."""


class HostError(Exception):
    """The host function raised. ``type`` is its exception's type name, ``message`` its text."""

    def __init__(self, type_name, message):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type = type_name
        self.message = message


class HttpError(OSError):
    """An HTTP request the policy allowed did not complete."""


def _raise(raw):
    try:
        error = msgpack.unpackb(raw.encode("latin-1"), raw=False)
        kind, type_name, message = error["kind"], error["type"], error["message"]
    except Exception:
        raise HostError("ProtocolError", "the host's error could not be read") from None
    if kind == "denied":
        raise CapabilityDenied(message)
    if kind == "http":
        raise HttpError(message)
    raise HostError(type_name, message)


def _invoke(name, args, kwargs):
    payload = msgpack.packb([list(args), kwargs], use_bin_type=True)
    try:
        reply = _channel.call(name, payload.decode("latin-1"))
    except _Err as err:
        error = err.value
    else:
        return msgpack.unpackb(reply.encode("latin-1"), raw=False, strict_map_key=False)
    _raise(error)  # outside the except block, so the guest's traceback shows no wire details


def call(name, /, *args, **kwargs):
    """Call the host function ``name`` with msgpack-compatible arguments; return its result."""
    if not isinstance(name, str):
        raise TypeError(f"a host function name must be a str, not {type(name).__name__}")
    return _invoke(name, args, kwargs)


def __getattr__(name):
    # host.lookup(42): any other attribute is a host function of that name. Dunder names are
    # Python's own protocols (copy, pickle, import machinery) and never host functions.
    if name.startswith("__"):
        raise AttributeError(name)

    def function(*args, **kwargs):
        return _invoke(name, args, kwargs)

    function.__name__ = function.__qualname__ = name
    return function


# The submodule is imported by name: `from host import http` would ask __getattr__ first.
http = __import__("importlib").import_module("host.http")
