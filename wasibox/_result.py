"""What a run produced: ``RunResult``, built by the same code for every backend, and its one
JSON form.

**Text.** Every ``str`` in a result is valid Unicode that encodes as UTF-8, whatever the guest
wrote. The guest's bytes (stdout, stderr) are decoded as UTF-8 with each undecodable
sequence replaced by U+FFFD, and its text (the exception's type, message and traceback, file
names, capability targets) has each lone surrogate (U+D800-U+DFFF, which a JSON ``\\udc80``
escape or a file name decoded with ``surrogateescape`` can carry) replaced by U+FFFD too:
one marker for text that was not valid, applied by ``clean_text``. (The exception reaches
the host as JSON, which reads an escaped high surrogate followed by a low one as the one
character they encode.) Replacement rather than an escape such as ``backslashreplace``,
because an escape is text the guest could have printed itself, and because every consumer
(a JSON encoder, an MCP transport, a terminal) accepts U+FFFD. NUL and other control
characters are valid UTF-8 and are kept (JSON escapes them; the CLI makes them inert on a
terminal). Values need no pass of their own here: msgpack decodes their strings as strict
UTF-8 and a reply that is not is a ``ProtocolError`` (batch replies, whose values are JSON,
are cleaned by ``wasibox/_batch.py``); the JSON form still cleans every string it writes.

**JSON.** ``RunResult.to_dict`` is the one JSON form of a result, used by ``wasibox serve``,
``wasibox run --json`` and the MCP server's JSON values (``json_value``). JSON has no bytes,
no NaN or infinity and only string keys, so these become tagged objects::

    b"\\x00\\xff"          -> {"base64": "AP8="}
    float("nan")         -> {"float": "nan"}     (also "inf" and "-inf")
    {1: "a", b"k": 2}    -> {"map": [[1, "a"], [{"base64": "aw=="}, 2]]}

A dict is written as a ``map`` when a key is not a str, and also when its only key is one of
the tags (``{"base64": "x"}`` from the guest), so a tagged object always means its tag.
Tuples are arrays.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import re
from typing import TYPE_CHECKING, Any, TypeVar

from ._events import CapabilityEvent
from ._limits import Limit
from ._wire import ProtocolError, decode_reply, max_elements

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


__all__ = ["FileRecord", "GuestException", "Outcome", "RefusedFile", "RunResult", "build_result",
           "clean_text", "clean_value", "json_value"]

#: A lone surrogate: a code point that a str can hold and UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")
#: The keys that make a one-key JSON object a tagged value rather than a dict.
_TAGS = frozenset({"base64", "float", "map"})


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD, so that it encodes as UTF-8."""
    if text.isascii():  # the common case, checked at C speed
        return text
    try:
        text.encode("utf-8")  # C speed too; the regex only runs on text that needs it
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def clean_value(value: Any) -> Any:
    """Plain data (lists, tuples, dicts, scalars) with ``clean_text`` applied to every str in
    it, dict keys included; other values are returned as they are."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list | tuple):
        return type(value)(clean_value(item) for item in value)
    if isinstance(value, dict):
        return {clean_value(key): clean_value(item) for key, item in value.items()}
    return value


def json_value(value: Any) -> Any:
    """A value from the guest as JSON data, in the form the module docstring describes.

    Raises TypeError for a type that is not a documented value type (only the host can build
    one: the guest's values are decoded to plain types).
    """
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    if isinstance(value, dict):
        if all(type(key) is str for key in value) and not (
                len(value) == 1 and next(iter(value)) in _TAGS):
            return {clean_text(key): json_value(item) for key, item in value.items()}
        return {"map": [[json_value(key), json_value(item)] for key, item in value.items()]}
    raise TypeError(f"a {type(value).__name__} is not a value wasibox can return")


_Record = TypeVar("_Record", bound="DataclassInstance")


def _clean_record(record: _Record) -> _Record:
    """A dataclass record (a file record, a capability event) with its str fields cleaned;
    the record itself when they were clean already."""
    changed: dict[str, str] = {}
    for field in dataclasses.fields(record):
        text = getattr(record, field.name)
        if isinstance(text, str) and (clean := clean_text(text)) is not text:
            changed[field.name] = clean
    return dataclasses.replace(record, **changed) if changed else record


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A file a run wrote under a writable mount, as published: guest path, size, sha256."""

    path: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class RefusedFile:
    """An entry of a staging tree that was not published, and why (symlink, FIFO, ...)."""

    path: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuestException:
    """An exception raised by guest code, as the guest saw it (no host frames or paths).

    The guest chose all three texts; lone surrogates in them become U+FFFD (``clean_text``).
    """

    type: str
    message: str
    traceback: str

    def __post_init__(self) -> None:
        for name in ("type", "message", "traceback"):
            object.__setattr__(self, name, clean_text(getattr(self, name)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """Everything one run produced.

    ``ok`` is True iff the run exited 0, raised nothing and exceeded no limit. Every str in it
    encodes as UTF-8 (see the module docstring for how guest text that did not is replaced).
    """

    ok: bool
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: GuestException | None
    limit_exceeded: Limit | None
    #: Fuel the run burnt (on the microVM, its CPU time at a fixed rate). Deterministic for a
    #: run that ends by itself or by its fuel limit. A run stopped by its timeout or a cancel
    #: reports what the engine had counted when it stopped, which is not deterministic and,
    #: inside a loop that calls nothing (``while True: pass``), can be far less than it burnt:
    #: Wasmtime keeps such a loop's count in a register and the stop does not write it back.
    fuel_used: int
    memory_peak_bytes: int
    duration_s: float
    backend: str
    #: The entry function's return value, for ``call``; None for ``run``.
    value: Any = None
    #: Files the run wrote under writable mounts, as published (only when ``ok``).
    files: list[FileRecord] = dataclasses.field(default_factory=list)
    #: Entries of the run's staging that were not published (symlinks, FIFOs, devices,
    #: hard links), with the reason; see wasibox.Mount.
    files_refused: list[RefusedFile] = dataclasses.field(default_factory=list)
    #: Every decision a capability made during the run (host calls, HTTP), in order.
    capability_log: tuple[CapabilityEvent, ...] = ()
    #: What isolated the guest: "wasm" (Wasmtime), or for the microVM "kvm" (hardware
    #: virtualization) or "tcg" (QEMU's software emulation, not a security boundary).
    isolation: str = "wasm"
    #: The package set the guest had (``name==version`` of each wheel, sorted); empty
    #: without ``packages=``. Results are deterministic per (guest digest, package set).
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Backends build results from guest text; so does dataclasses.replace. Cleaning here
        # holds for every path, and costs a C-speed scan of text that is already valid.
        for name in ("stdout", "stderr"):
            object.__setattr__(self, name, clean_text(getattr(self, name)))
        object.__setattr__(self, "files", [_clean_record(r) for r in self.files])
        object.__setattr__(self, "files_refused", [_clean_record(r) for r in self.files_refused])
        object.__setattr__(self, "capability_log",
                           tuple(_clean_record(event) for event in self.capability_log))

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON data: the one JSON form that ``wasibox serve``, the MCP server
        and ``wasibox run --json`` share (bytes, non-finite floats and maps with keys that are
        not str as tagged objects; see the module docstring).

        Raises TypeError if ``value`` holds a type that is not a documented value type.
        """
        data = dataclasses.asdict(self)
        data["limit_exceeded"] = self.limit_exceeded.value if self.limit_exceeded else None
        data["value"] = json_value(self.value)
        data["capability_log"] = [json_value(event) for event in data["capability_log"]]
        data["packages"] = list(self.packages)
        return data

    @property
    def _status(self) -> str:
        """One line: ``ok``, the limit exceeded, the guest's exception or its exit status."""
        if self.limit_exceeded is not None:
            return f"exceeded its {self.limit_exceeded.value} limit"
        if self.error is not None:
            return _clip(f"{self.error.type}: {self.error.message}", 120)
        return "ok" if self.ok else f"exited with status {self.exit_code}"

    def __repr__(self) -> str:
        """A short summary; every field is an attribute (``to_dict()`` gives them all)."""
        parts = [self._status, f"fuel_used={self.fuel_used:,}",
                 f"duration_s={self.duration_s:.4f}"]
        for name in ("stdout", "stderr"):
            text = getattr(self, name)
            if text:
                parts.append(f"{name}={_clip(text, 40)!r}")
        if self.value is not None:
            parts.append(f"value={_clip(repr(self.value), 60)}")
        if self.files:
            parts.append(f"files={len(self.files)}")
        return f"<RunResult {' '.join(parts)}>"

    def _repr_html_(self) -> str:
        """A small table for Jupyter; guest text is escaped and clipped to 2,000 characters."""
        rows = [("status", self._status), ("exit code", str(self.exit_code)),
                ("fuel used", f"{self.fuel_used:,}"),
                ("memory peak", f"{self.memory_peak_bytes / 2**20:,.1f} MiB"),
                ("duration", f"{self.duration_s * 1000:,.1f} ms"),
                ("backend", f"{self.backend} ({self.isolation})")]
        for name in ("stdout", "stderr"):
            text = getattr(self, name)
            if text:
                truncated = " (truncated by the output limit)" \
                    if getattr(self, f"{name}_truncated") else ""
                rows.append((name + truncated, _clip(text, 2000)))
        if self.value is not None:
            rows.append(("value", _clip(repr(self.value), 2000)))
        if self.files:
            rows.append(("files", "\n".join(f"{f.path} ({f.size:,} bytes)"
                                             for f in self.files[:20])))
        body = "".join(f"<tr><th style=\"text-align:left\">{html.escape(name)}</th>"
                       f"<td style=\"text-align:left\"><pre style=\"margin:0\">"
                       f"{html.escape(value)}</pre></td></tr>" for name, value in rows)
        return f"<table>{body}</table>"


def _clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """What a backend observed while running one job; ``build_result`` turns it into a result.

    Everything here is measured by the host, except ``reply``, the guest's own (untrusted)
    account of how its code ended, still encoded.
    """

    reply: str | None = None
    #: ``reply`` read already, when it is the plain reply of most runs (no error, no value):
    #: (exit_code, memory_error, heap_top). Set by a backend that reads it in C, in the
    #: one form ``wasibox/_wire.py``'s ``decode_reply`` reads without its JSON parser.
    plain_reply: tuple[int, bool, int] | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    limit_exceeded: Limit | None = None
    #: A fault the guest caused that is not a limit (a trap, an os._exit), described for it.
    fault: GuestException | None = None
    #: The status passed to os._exit, when the guest ended that way.
    exit_code: int | None = None
    fuel_used: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    duration_s: float = 0.0
    #: Every decision a capability made during the run, in order.
    capability_log: tuple[CapabilityEvent, ...] = ()
    isolation: str = "wasm"
    #: The package set the guest had (``name==version`` of each wheel, sorted); empty
    #: without ``packages=``. Results are deterministic per (guest digest, package set).
    packages: tuple[str, ...] = ()


def build_result(outcome: Outcome, backend: str, reply_limit: int,
                 packages: tuple[str, ...] = ()) -> RunResult:
    """Combine a backend's measurements with the guest's decoded reply; ``packages`` is
    the package set the guest had."""
    exit_code = outcome.exit_code
    error = outcome.fault
    value = None
    limit = outcome.limit_exceeded
    memory_peak = outcome.memory_peak_bytes
    if outcome.reply is not None and limit is None:
        try:
            if outcome.plain_reply is not None:  # read by the backend: no error, no value
                reply_exit_code, memory_error, heap_top = outcome.plain_reply
            else:
                reply = decode_reply(outcome.reply, reply_limit,
                                     max_elements(outcome.memory_limit_bytes))
                reply_exit_code, memory_error, heap_top = (
                    reply.exit_code, reply.memory_error, reply.heap_top)
                value = reply.value
                if reply.error is not None:
                    error = GuestException(**reply.error)
        except ProtocolError as exc:
            error = GuestException(type="ProtocolError", message=str(exc), traceback="")
            exit_code = 1
        else:
            exit_code = reply_exit_code if exit_code is None else exit_code
            memory_peak = max(memory_peak, min(heap_top, outcome.memory_limit_bytes))
            if (memory_error and error is not None and error.type == "MemoryError"
                    and not error.message):
                # The allocation that failed was the one that would have crossed the cap.
                # (An allocator failure raises a bare MemoryError; one with a message, such
                # as the parser's "too complex to parse", is a guest error, not the cap.)
                limit = Limit.MEMORY
                memory_peak = max(memory_peak, outcome.memory_limit_bytes)
    if limit is Limit.MEMORY:
        memory_peak = max(memory_peak, outcome.memory_limit_bytes)
    if exit_code is None:
        exit_code = 1 if (limit is not None or error is not None) else 0
    fields: dict[str, Any] = {
        "ok": exit_code == 0 and error is None and limit is None,
        "exit_code": exit_code,
        # Decoded with replacement: valid text, with no lone surrogate to clean.
        "stdout": outcome.stdout.decode("utf-8", errors="replace"),
        "stderr": outcome.stderr.decode("utf-8", errors="replace"),
        "stdout_truncated": outcome.stdout_truncated,
        "stderr_truncated": outcome.stderr_truncated,
        "error": error,  # a GuestException cleans its own text
        "limit_exceeded": limit,
        "fuel_used": outcome.fuel_used,
        "memory_peak_bytes": memory_peak,
        "duration_s": outcome.duration_s,
        "backend": backend,
        "value": value,
        "files": [],
        "files_refused": [],
        "capability_log": outcome.capability_log,
        "isolation": outcome.isolation,
        "packages": packages,
    }
    if outcome.capability_log:
        return RunResult(**fields)  # its events' text is cleaned there
    return _clean_result(fields)


def _clean_result(fields: dict[str, Any]) -> RunResult:
    """The RunResult of ``fields``, every one clean already (valid text, no capability log),
    so ``__post_init__`` would change nothing: skipping it and the frozen ``__init__``'s
    twenty ``object.__setattr__`` calls took ~4 us (hot) off every run's host time."""
    result = object.__new__(RunResult)
    result.__dict__.update(fields)
    return result
