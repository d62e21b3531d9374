"""Host functions: the one channel through which guest code calls code the host grants.

**Threat.** Host functions run in the host process, with its privileges, on input the guest
chose. The guest controls the function name, every payload byte, how often it calls and how
much it sends. This module makes sure that it can call only what was granted (a call to any
other name is refused from its name alone, before its payload is looked at), cannot crash or
exhaust the host with huge, deeply nested or malformed payloads (each is sized, then walked
from its declared lengths and counts by ``wasibox._wire.unpack``, *before* msgpack decodes
it, so decoding it costs at most ``max_elements(memory_bytes)`` elements), cannot outlive the
run's deadline by making a host function block or by calling after it, and learns nothing
about the host from a failure: no host traceback, no host paths, one uniform message for
every denial.

It is backend-agnostic: a backend hands each call from its guest to ``HostCalls.handle`` and
turns ``StopRun`` into the end of the run. The built-in HTTP client (``capabilities/http.py``) is
one more function behind the same channel. The contract is ``guest/wit/host.wit``.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from .._errors import UsageError
from .._events import CapabilityEvent
from .._limits import Limit, Limits
from .._wire import ProtocolError, max_elements, unpack

__all__ = ["DENIED_MESSAGE", "HTTP_FUNCTION", "CallRefused", "HostCalls", "HostReply", "StopRun",
           "check_functions", "host_error_message"]

#: What the guest is told for every refusal, whatever the reason, so a refusal never says
#: whether a function or a host exists.
DENIED_MESSAGE = "not permitted by the sandbox's policy"
#: The name the guest reaches the built-in HTTP client by: not an identifier, so it cannot
#: clash with a registered function.
HTTP_FUNCTION = "@http"
#: How often a wait for a host function looks at the run's cancel event.
_POLL_S = 0.05
#: A worker thread with nothing to do for this long ends.
_IDLE_S = 30.0
_MAX_MESSAGE_CHARS = 2000
# An absolute path in a message (after a quote, space, bracket, '=' or at the start). A URL's
# "//" never matches: the character before its first slash is ':', the one before its second
# is '/'.
_PATH = re.compile(r"""(?:(?<=^)|(?<=[\s'"(\[=,]))/[^\s'"()\[\],:]*""")


class StopRun(Exception):
    """The call must end the run with ``limit`` (raised by ``HostCalls.handle``)."""

    def __init__(self, limit: Limit) -> None:
        super().__init__(limit.value)
        self.limit = limit


@dataclasses.dataclass(frozen=True, slots=True)
class HostReply:
    """The answer to one call: ``ok`` and the encoded payload, latin-1 text either way."""

    ok: bool
    payload: str


class CallRefused(Exception):
    """An expected failure of one call, reported to the guest as ``err``.

    ``kind`` is the contract's error kind (``denied``, ``error``, ``invalid``, ``http``);
    ``type_name`` and ``message`` are what the guest sees; ``reason`` is for the audit log.
    """

    def __init__(self, kind: str, type_name: str, message: str, reason: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.type_name = type_name
        self.message = message
        self.reason = reason


def check_functions(functions: Mapping[str, Callable[..., Any]] | None
                    ) -> dict[str, Callable[..., Any]]:
    """Validate ``Sandbox(functions=...)``: identifiers mapped to callables.

    Raises UsageError naming the first bad entry.
    """
    if functions is None:
        return {}
    if not isinstance(functions, Mapping):
        raise UsageError("functions must be a mapping of names to callables, such as "
                         "{'lookup': lookup}")
    checked: dict[str, Callable[..., Any]] = {}
    for name, function in functions.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
            raise UsageError(f"a host function name must be a Python identifier that does not "
                             f"start with '__', not {name!r}")
        if not callable(function):
            raise UsageError(f"host function {name!r} is not callable")
        checked[name] = function
    return checked


def host_error_message(exc: BaseException) -> str:
    """The text of a host function's exception as the guest may see it: no host paths."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not take the call down
        text = "<the message could not be formatted>"
    text = _PATH.sub("<path>", text)
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


class _Job:
    __slots__ = ("work", "done", "value", "error")

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        # Held until the work is done: a bare lock is the cheapest hand-off between threads
        # (an Event allocates a new lock for every wait).
        self.done = threading.Lock()
        self.done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None


class _Workers:
    """Daemon threads that run host functions, so a caller can stop waiting at a deadline.

    A function that never returns keeps its thread forever; being a daemon, it does not hold
    up the host's exit, and the next call gets another thread. Idle threads end after a while.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, work: Callable[[], Any]) -> _Job:
        job = _Job(work)
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserved: an idle thread will take this job
            else:
                threading.Thread(target=self._serve, name="wasibox-host-call",
                                 daemon=True).start()
        self._jobs.put(job)
        return job

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # not reserved by a submit: end this thread
                        self._idle -= 1
                        return
                continue
            try:
                job.value = job.work()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                job.error = exc
            job.done.release()
            del job
            with self._lock:
                self._idle += 1


_workers = _Workers()


class HostCalls:
    """The per-run state of the host-call channel: counters, limits and the audit log.

    One per run; ``handle`` is called from the thread running the guest. ``log`` collects a
    ``CapabilityEvent`` for every decision (other capabilities may append to it too).
    """

    def __init__(self, *, functions: Mapping[str, Callable[..., Any]], limits: Limits,
                 http: Callable[[dict[str, Any], float, list[CapabilityEvent]], Any] | None,
                 cancel: threading.Event | None = None,
                 log: list[CapabilityEvent] | None = None) -> None:
        self._functions = functions
        self._limits = limits
        self._http = http
        self._cancel = cancel or threading.Event()
        self.log: list[CapabilityEvent] = log if log is not None else []
        self.calls = 0
        self.bytes = 0

    def handle(self, name: str, payload: str, deadline: float = math.inf) -> HostReply:
        """Answer one call from the guest.

        Returns the reply for the guest (``err`` for a refusal, a malformed payload or a
        failing host function). Raises StopRun when the call breaks a limit: too many calls,
        a payload or reply over ``host_call_bytes``, or over ``host_total_bytes`` in total
        (``Limit.HOST_CALLS``), or the run's deadline passed or the run was cancelled before
        or while the host function ran (``Limit.TIMEOUT``).

        The work a call costs the host before it is refused is bounded by the call, not by
        its payload: the limits and the name are checked first (a name that was never
        granted costs O(1) whatever its payload), then the payload is walked within its
        element cap before it is decoded.
        """
        limits = self._limits
        if self._cancel.is_set() or time.monotonic() >= deadline:
            raise StopRun(Limit.TIMEOUT)
        self.calls += 1
        if self.calls > limits.host_calls:
            raise StopRun(Limit.HOST_CALLS)
        # Sized before anything is copied or decoded: one char per byte.
        self._count_bytes(len(payload))
        started = time.perf_counter()
        is_http = name == HTTP_FUNCTION
        capability, action, logged = ("http", "request", name) if is_http else (
            "function", "call", name)
        try:
            target = self._resolve(name)
            args, kwargs = self._decode(payload, max_elements(limits.memory_bytes))
            if is_http:  # logged by method and URL, as the HTTP gate logs them
                action = str(kwargs.get("method"))[:16]
                logged = str(kwargs.get("url"))
            if is_http:
                value = self._run(lambda: self._http_call(args, kwargs, deadline), deadline,
                                  name)
            else:
                value = self._run(lambda: target(*args, **kwargs), deadline, name)
            try:
                encoded = msgpack.packb(value, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise CallRefused("error", "TypeError",
                               f"the return value of host function {name!r} cannot cross "
                               f"the boundary: {host_error_message(exc)}",
                               "return value not msgpack-compatible") from None
            self._count_bytes(len(encoded))
        except CallRefused as refusal:
            if not is_http or refusal.kind == "invalid" or self._http is None:
                self.log.append(CapabilityEvent(
                    capability=capability, action=action, target=_printable(logged),
                    allowed=refusal.kind not in ("denied", "invalid"),
                    bytes_sent=len(payload), duration_s=time.perf_counter() - started,
                    reason=refusal.reason))
            error = msgpack.packb({"kind": refusal.kind, "type": refusal.type_name,
                                   "message": refusal.message}, use_bin_type=True)
            return HostReply(False, error.decode("latin-1"))
        if not is_http:
            self.log.append(CapabilityEvent(
                capability=capability, action=action, target=name, allowed=True,
                bytes_sent=len(payload), bytes_received=len(encoded),
                duration_s=time.perf_counter() - started))
        return HostReply(True, encoded.decode("latin-1"))

    # -- the steps of a call -------------------------------------------------------------------

    def _count_bytes(self, size: int) -> None:
        self.bytes += size
        if size > self._limits.host_call_bytes or self.bytes > self._limits.host_total_bytes:
            raise StopRun(Limit.HOST_CALLS)

    def _resolve(self, name: str) -> Callable[..., Any]:
        if name == HTTP_FUNCTION:
            if self._http is None:
                raise CallRefused("denied", "CapabilityDenied", DENIED_MESSAGE,
                               "HTTP is not granted")
            return self._http_call
        function = self._functions.get(name)
        if function is None:
            raise CallRefused("denied", "CapabilityDenied", DENIED_MESSAGE,
                           "no host function of this name")
        return function

    @staticmethod
    def _decode(payload: str, elements: int) -> tuple[list[Any], dict[str, Any]]:
        try:
            decoded, _ = unpack(payload.encode("latin-1"), "the payload", elements)
        except (UnicodeError, ProtocolError) as exc:
            reason = str(exc) if isinstance(exc, ProtocolError) else type(exc).__name__
            raise CallRefused("invalid", "ProtocolError", "the call's payload is malformed",
                           f"malformed payload: {reason}") from None
        if (not isinstance(decoded, list) or len(decoded) != 2
                or not isinstance(decoded[0], list) or not isinstance(decoded[1], dict)
                or not all(isinstance(key, str) for key in decoded[1])):
            raise CallRefused("invalid", "ProtocolError", "the call's payload is malformed",
                           "payload is not [args, kwargs]")
        return decoded[0], decoded[1]

    def _http_call(self, args: list[Any], kwargs: dict[str, Any], deadline: float) -> Any:
        assert self._http is not None
        if args:
            raise CallRefused("invalid", "ProtocolError", "the call's payload is malformed",
                           "HTTP request with positional arguments")
        return self._http(kwargs, deadline, self.log)

    def _run(self, work: Callable[[], Any], deadline: float, name: str) -> Any:
        """Run ``work`` on a worker thread; stop waiting at the deadline or on cancel."""
        job = _workers.submit(work)
        while not job.done.acquire(timeout=min(_POLL_S, max(deadline - time.monotonic(), 0.0))):
            if self._cancel.is_set() or time.monotonic() >= deadline:
                self.log.append(CapabilityEvent(
                    capability="http" if name == HTTP_FUNCTION else "function",
                    action="request" if name == HTTP_FUNCTION else "call",
                    target=_printable(name), allowed=True, reason="still running at the deadline"))
                raise StopRun(Limit.TIMEOUT)
        if job.error is None:
            return job.value
        error = job.error
        if isinstance(error, CallRefused):
            raise error
        raise CallRefused("error", type(error).__name__, host_error_message(error),
                       f"raised {type(error).__name__}") from None


def _printable(name: str) -> str:
    """A guest-chosen name, safe to log: printable and bounded."""
    text = name if name.isprintable() else name.encode("unicode_escape").decode("ascii")
    return text[:2000]
