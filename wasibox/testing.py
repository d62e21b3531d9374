"""Property-based testing of guest code with hypothesis; every call runs in a fresh sandbox.

::

    from hypothesis import given
    import wasibox.testing as wt

    parse = wt.guest_function(code, "parse")
    @given(parse.strategy())
    def test_parse_never_crashes(args):
        r = parse.run(*args)
        assert r.limit_exceeded is None and r.error is None

``guest_function`` reads the function's signature from the source with ``ast``, on the host,
without ever executing guest code there. ``fuzz`` drives hypothesis itself: it runs every
example twice (to catch nondeterminism), steers towards inputs that burn the most fuel
(``hypothesis.target``), and reports each failure with its shrunk example, saved to a file,
and a short replay command.

Needs the ``hypothesis`` package (``pip install 'wasibox[testing]'``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import hypothesis
from hypothesis import strategies as st

from ._batch import batch_elements, decode_batch_reply, encode_records
from ._errors import UsageError
from ._limits import Limits
from ._result import GuestException, RunResult, build_result
from ._sandbox import sandbox_for, unwrap
from ._select import parse
from ._transform import BATCH_REPLY_LIMIT, _canonical
from ._wire import ProtocolError
from .backends.base import Backend
from .capabilities.files.mount import format_mount

__all__ = ["FuzzFailure", "FuzzReport", "GuestFunction", "fuzz", "guest_function",
           "read_example", "replay", "settings_profiles", "strategy_for"]

#: Characters that parsers treat specially. A third of the generated ``str`` arguments are
#: drawn from these alone, so that short runs of them (a digit then a NUL, nested brackets)
#: turn up within a few dozen examples instead of a few thousand.
INTERESTING_CHARACTERS = "0123456789\x00\n \"'\\()[]{},:-.e"


def _sized(elements: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Text whose length is log-uniform up to 4096: one integer choice sets the scale, which
    both covers long inputs early and gives fuel targeting a knob to turn."""
    return st.integers(0, 12).flatmap(
        lambda k: st.text(elements, min_size=2**k // 2, max_size=2**k))


#: ``str`` inside containers, and ``str`` / ``bytes`` parameters (with long inputs too).
SHORT_TEXT = st.text() | st.text(st.sampled_from(INTERESTING_CHARACTERS))
TEXT = (SHORT_TEXT | _sized(st.sampled_from(INTERESTING_CHARACTERS))
        | _sized(st.sampled_from(INTERESTING_CHARACTERS) | st.characters()))
BINARY = st.binary() | st.integers(0, 12).flatmap(
    lambda k: st.binary(min_size=2**k // 2, max_size=2**k))
#: Plain data that crosses the boundary exactly: what an unannotated parameter receives.
_SCALAR = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | SHORT_TEXT | st.binary())
PLAIN_DATA = st.recursive(
    _SCALAR,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)

_NAMES: dict[str, st.SearchStrategy[Any]] = {
    "int": st.integers(), "float": st.floats(), "str": SHORT_TEXT, "bytes": st.binary(),
    "bool": st.booleans(), "None": st.none(), "NoneType": st.none(), "Any": PLAIN_DATA,
    "object": PLAIN_DATA, "bytearray": st.binary(),
}
_GENERIC_LISTS = {"list", "List", "Sequence", "Iterable", "Collection", "MutableSequence"}
_GENERIC_DICTS = {"dict", "Dict", "Mapping", "MutableMapping"}


def settings_profiles() -> dict[str, hypothesis.settings]:
    """Hypothesis settings that suit fresh-instance fuzzing (registered by the pytest plugin).

    * ``wasibox``: the default; no per-example deadline (a fresh instance costs a few ms and
      a loaded machine can double that), no too-slow health check, 100 examples.
    * ``wasibox-quick``: 20 examples, for a fast edit-test loop.
    * ``wasibox-ci``: 500 examples, derandomized and with no example database, so a CI run
      is reproducible from its log alone.
    """
    base = {"deadline": None,
            "suppress_health_check": [hypothesis.HealthCheck.too_slow,
                                      hypothesis.HealthCheck.data_too_large]}
    return {
        "wasibox": hypothesis.settings(max_examples=100, **base),  # type: ignore[arg-type]
        "wasibox-quick": hypothesis.settings(max_examples=20, **base),  # type: ignore[arg-type]
        "wasibox-ci": hypothesis.settings(max_examples=500, derandomize=True, database=None,
                                          print_blob=True, **base),  # type: ignore[arg-type]
    }


class GuestFunction:
    """A guest function that runs in a fresh sandbox on every call.

    Arguments cross as plain data (see ``wasibox.Transform``); tuples stay tuples.
    """

    def __init__(self, code: str, entry: str, *, limits: Limits | None = None, seed: int = 0,
                 clock: Literal["virtual", "real"] = "virtual",
                 entropy: Literal["seeded", "real"] = "seeded",
                 backend: Literal["wasm"] | Backend = "wasm",
                 strategies: Mapping[str, st.SearchStrategy[Any]] | None = None,
                 **sandbox_options: Any) -> None:
        if not isinstance(entry, str) or not entry.isidentifier():
            raise UsageError(f"entry must name a function, such as 'parse', not {entry!r}")
        self.code = code
        self.entry = entry
        self.parameters = signature_of(code, entry)
        self._overrides = dict(strategies or {})
        self._sandbox = sandbox_for(code, limits, seed=seed, clock=clock, entropy=entropy,
                                    backend=backend, **sandbox_options)

    def package_flags(self) -> list[str]:
        """The package set this function's guest has, as ``wasibox fuzz`` flags (exact
        pins, so a replay resolves the same wheels)."""
        package_set = self._sandbox.package_set
        pins = package_set.pins if package_set is not None else ()
        return [part for pin in pins for part in ("--package", pin)]

    def __call__(self, *args: Any) -> Any:
        """Call the function; return its value or raise GuestError / LimitExceeded."""
        return unwrap(self.run(*args))

    def run(self, *args: Any) -> RunResult:
        """Call the function and return the whole outcome; never raises for guest faults.

        Raises UsageError for arguments that are not plain data.
        """
        try:
            payload = encode_records([args])
        except (ValueError, TypeError) as exc:
            raise UsageError(f"arguments must be plain data: {exc}") from None
        outcome = self._sandbox._execute_batch(self.code, self.entry, payload, star=True)
        base = build_result(outcome.__class__(**{**outcome.__dict__, "reply": None}),
                            self._sandbox._backend.name, 0)
        if outcome.reply is None or base.limit_exceeded is not None:
            return base
        try:
            reply = decode_batch_reply(outcome.reply, 1, BATCH_REPLY_LIMIT, batch_elements(
                self._sandbox.limits.memory_bytes, 1))
        except ProtocolError as exc:
            error: GuestException | None = GuestException(type="ProtocolError",
                                                          message=str(exc), traceback="")
            return dataclasses.replace(base, ok=False, exit_code=1, error=error)
        described = reply.error or reply.errors.get(0)
        if described is None:
            return dataclasses.replace(base, value=reply.values[0])
        error = GuestException(**described)
        if error.type == "SystemExit" and error.message in ("", "0", "None"):
            return base  # sys.exit(0) ends the call normally, as in Sandbox.call
        limit = base.limit_exceeded
        if reply.memory_error and error.type == "MemoryError":
            from ._limits import Limit

            limit = Limit.MEMORY
        return dataclasses.replace(base, ok=False, exit_code=1, error=error,
                                   limit_exceeded=limit)

    def strategy(self) -> st.SearchStrategy[tuple[Any, ...]]:
        """A strategy for the function's positional arguments, from its annotations.

        Raises UsageError for an annotation it cannot map (pass ``strategies={name: ...}``).
        """
        parts = []
        for name, annotation in self.parameters:
            if name in self._overrides:
                parts.append(self._overrides[name])
            else:
                parts.append(strategy_for(annotation, name))
        return st.tuples(*parts)

    def close(self) -> None:
        self._sandbox.close()

    def __repr__(self) -> str:
        return f"<wasibox.testing.GuestFunction {self.entry}>"


def guest_function(code: str, entry: str, **options: Any) -> GuestFunction:
    """A callable handle on guest function ``entry`` of ``code``; see GuestFunction."""
    return GuestFunction(code, entry, **options)


def signature_of(code: str, entry: str) -> list[tuple[str, ast.expr | None]]:
    """The positional parameters of ``entry`` and their annotations, read with ``ast``.

    Raises UsageError if the code does not parse or defines no such top-level function.
    """
    try:
        tree = parse(code)
    except SyntaxError as exc:
        raise UsageError(f"the code does not parse: {exc}") from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry:
            arguments = node.args
            required_kwonly = [a.arg for a, d in zip(arguments.kwonlyargs,
                                                     arguments.kw_defaults, strict=True)
                               if d is None]
            if required_kwonly:
                raise UsageError(f"{entry} has required keyword-only parameters "
                                 f"{required_kwonly}; only positional ones can be generated")
            return [(a.arg, a.annotation) for a in [*arguments.posonlyargs, *arguments.args]]
    raise UsageError(f"the code defines no top-level function named {entry!r}")


def strategy_for(annotation: ast.expr | str | None, name: str = "?") -> st.SearchStrategy[Any]:
    """The strategy for an annotation given as source text or an ``ast`` node.

    No annotation means any plain data. Raises UsageError for what it cannot map.
    """
    if annotation is None:
        return PLAIN_DATA
    node = parse(annotation, "eval").body if isinstance(annotation, str) else annotation
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = parse(node.value, "eval").body
    if isinstance(node, ast.Name) and node.id in ("str", "bytes"):
        # A parameter of its own may be long: parsers and codecs go quadratic on size.
        return TEXT if node.id == "str" else BINARY
    return _strategy(node, name)


def _strategy(node: ast.expr, name: str) -> st.SearchStrategy[Any]:
    if isinstance(node, ast.Constant):
        if node.value is None:
            return st.none()
        if isinstance(node.value, str):  # a string annotation: "int", "list[str]"
            return strategy_for(node.value, name)
    if isinstance(node, ast.Name | ast.Attribute):
        base = node.id if isinstance(node, ast.Name) else node.attr
        if base in _NAMES:
            return _NAMES[base]
        if base in _GENERIC_LISTS:
            return st.lists(PLAIN_DATA)
        if base in _GENERIC_DICTS:
            return st.dictionaries(st.text(), PLAIN_DATA)
        if base in ("tuple", "Tuple"):
            return st.lists(PLAIN_DATA).map(tuple)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _strategy(node.left, name) | _strategy(node.right, name)
    if isinstance(node, ast.Subscript):
        base_node = node.value
        base = (base_node.id if isinstance(base_node, ast.Name)
                else base_node.attr if isinstance(base_node, ast.Attribute) else "")
        items = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base in _GENERIC_LISTS:
            return st.lists(_strategy(items[0], name))
        if base in ("set", "Set", "frozenset", "FrozenSet"):
            inner = _strategy(items[0], name)
            return st.sets(inner) if base.lower() == "set" else st.frozensets(inner)
        if base in _GENERIC_DICTS and len(items) == 2:
            return st.dictionaries(_strategy(items[0], name), _strategy(items[1], name))
        if base in ("tuple", "Tuple"):
            if len(items) == 2 and isinstance(items[1], ast.Constant) \
                    and items[1].value is Ellipsis:
                return st.lists(_strategy(items[0], name)).map(tuple)
            return st.tuples(*(_strategy(item, name) for item in items))
        if base == "Optional":
            return st.none() | _strategy(items[0], name)
        if base == "Union":
            return st.one_of(*(_strategy(item, name) for item in items))
        if base == "Literal" and all(isinstance(item, ast.Constant) for item in items):
            return st.sampled_from([item.value for item in items])  # type: ignore[attr-defined]
        if base == "Annotated":
            return _strategy(items[0], name)
    raise UsageError(f"cannot derive a strategy for parameter {name!r} from its annotation "
                     f"{ast.unparse(node)!r}; pass strategies={{{name!r}: ...}}")


# -- fuzz --------------------------------------------------------------------------------------

Kind = Literal["exception", "limit", "nondeterministic"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FuzzFailure:
    """One distinct failure ``fuzz`` found, with its shrunk example."""

    kind: Kind
    #: The shrunk positional arguments that trigger it.
    example: tuple[Any, ...]
    message: str
    #: One short shell line that reruns the example, saved to a file (see ``fuzz``).
    replay: str

    def __str__(self) -> str:
        return (f"{self.kind}: {self.message}\n  example: {_short(self.example)}\n"
                f"  replay:  {self.replay}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FuzzReport:
    """What ``fuzz`` found. ``ok`` is True when no example failed."""

    entry: str
    examples: int
    elapsed_s: float
    failures: list[FuzzFailure]
    #: The most fuel one example burnt, that example, and the least and median over all.
    max_fuel: int
    max_fuel_example: tuple[Any, ...] | None
    min_fuel: int
    median_fuel: float

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def fuel_ratio(self) -> float:
        """The costliest example's fuel over the cheapest one's: how far fuel targeting got.

        Every run pays a fixed cost (a fresh instance, loading the code), so a function
        whose cost does not grow with its input stays near 1.
        """
        return self.max_fuel / self.min_fuel if self.min_fuel else 0.0

    def __str__(self) -> str:
        lines = [f"fuzzed {self.entry}: {self.examples} examples in {self.elapsed_s:.1f}s "
                 f"({self.examples_per_s:.0f}/s), each run twice in fresh sandboxes",
                 f"fuel: min {self.min_fuel:,}, median {self.median_fuel:,.0f}, max "
                 f"{self.max_fuel:,} ({self.fuel_ratio:.1f}x the min) for "
                 f"{_short(self.max_fuel_example)}"]
        if not self.failures:
            lines.append("no failures")
        lines.extend(str(failure) for failure in self.failures)
        return "\n".join(lines)


class _Finding(Exception):
    kind: Kind = "exception"

    def __init__(self, message: str, example: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.example = example


class _GuestRaised(_Finding):
    kind = "exception"


class _GuestLimit(_Finding):
    kind = "limit"


class _Nondeterministic(_Finding):
    kind = "nondeterministic"


def fuzz(code: str, entry: str, *, max_examples: int = 100, seed: int = 0,
         limits: Limits | None = None, clock: Literal["virtual", "real"] = "virtual",
         entropy: Literal["seeded", "real"] = "seeded", target_fuel: bool = True,
         check_determinism: bool = True,
         strategies: Mapping[str, st.SearchStrategy[Any]] | None = None,
         path: str | None = None, replay_dir: str | os.PathLike[str] | None = None,
         backend: Literal["wasm"] | Backend = "wasm", **sandbox_options: Any) -> FuzzReport:
    """Fuzz ``entry`` with arguments drawn from its annotations; report what failed.

    Each example runs twice, each time in a fresh sandbox: a guest exception, an exceeded
    limit, or two runs that differ (value, error, output or fuel) is a failure, shrunk by
    hypothesis. With ``target_fuel``, ``hypothesis.target`` steers towards examples that
    burn more fuel, so algorithmic-complexity problems surface in ``max_fuel``. The search
    is seeded by ``seed``, so the same call finds the same examples.

    Each failure's shrunk example is saved as a Python literal in ``replay_dir`` (a new
    temporary directory when None), with the code itself unless ``path`` names the file it
    came from, and its ``replay`` is a short ``wasibox fuzz FILE --entry ENTRY
    --replay-file EXAMPLE`` line (with the run's limits and clock) that reruns it. Other
    sandbox options (mounts, host functions) are not part of that line.

    Raises UsageError for a bad entry or an annotation it cannot map.
    """
    function = GuestFunction(code, entry, limits=limits, seed=0, clock=clock, entropy=entropy,
                             backend=backend, strategies=strategies, **sandbox_options)
    strategy = function.strategy()
    fuels: list[int] = []
    slowest: list[Any] = [0, None]
    found: dict[str, _Finding] = {}

    # The second run of each example runs on a worker thread at the same time as the first
    # (wasm runs without the GIL): still two fresh instances, in about the time of one.
    twin_runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wasibox-fuzz")

    def check(args: tuple[Any, ...]) -> None:
        twin = twin_runner.submit(function.run, *args) if check_determinism else None
        first = function.run(*args)
        fuels.append(first.fuel_used)
        if first.fuel_used > slowest[0]:
            slowest[:] = [first.fuel_used, args]
        if target_fuel:
            hypothesis.target(float(first.fuel_used), label="fuel")
        if twin is not None:
            second = twin.result()
            difference = _difference(first, second)
            if difference:
                raise _Nondeterministic(f"two runs differ in {difference}", args)
        if first.limit_exceeded is not None:
            raise _GuestLimit(f"exceeded its {first.limit_exceeded.value} limit "
                              f"(fuel used {first.fuel_used:,})", args)
        if first.error is not None:
            raise _GuestRaised(f"{first.error.type}: {first.error.message}", args)
        if first.exit_code != 0:
            raise _GuestRaised(f"exited with status {first.exit_code}", args)

    settings = hypothesis.settings(
        settings_profiles()["wasibox"], max_examples=max_examples, database=None,
        report_multiple_bugs=True, phases=list(hypothesis.Phase))
    test = hypothesis.seed(seed)(settings(hypothesis.given(strategy)(check)))
    started = time.perf_counter()
    try:
        test()
    except _Finding as finding:
        found[finding.kind] = finding
    except BaseExceptionGroup as group:  # several distinct failures, each shrunk
        for each in _findings(group):
            found.setdefault(each.kind, each)
    finally:
        twin_runner.shutdown()
    elapsed = time.perf_counter() - started
    if found and replay_dir is None:
        replay_dir = tempfile.mkdtemp(prefix="wasibox-fuzz-")
    failures = [FuzzFailure(kind=f.kind, example=f.example, message=str(f),
                            replay=_replay(code, entry, f, path, Path(replay_dir or "."),
                                           limits, clock, sandbox_options.get("mounts", ()),
                                           function.package_flags()))
                for f in found.values()]
    function.close()
    return FuzzReport(entry=entry, examples=len(fuels), elapsed_s=elapsed, failures=failures,
                      max_fuel=slowest[0], max_fuel_example=slowest[1],
                      min_fuel=min(fuels, default=0),
                      median_fuel=statistics.median(fuels) if fuels else 0.0)


def _short(example: Any, limit: int = 200) -> str:
    text = repr(example)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _findings(group: BaseExceptionGroup[Any]) -> list[_Finding]:
    out: list[_Finding] = []
    for exc in group.exceptions:
        if isinstance(exc, _Finding):
            out.append(exc)
        elif isinstance(exc, BaseExceptionGroup):
            out.extend(_findings(exc))
        else:
            raise exc
    return out


def _difference(first: RunResult, second: RunResult) -> str:
    """Which observable parts of two runs of the same example differ ('' if none)."""
    parts = []
    if _canonical(first.value) != _canonical(second.value):
        parts.append("value")
    if (first.error and (first.error.type, first.error.message)) != \
            (second.error and (second.error.type, second.error.message)):
        parts.append("error")
    if first.limit_exceeded != second.limit_exceeded:
        parts.append("limit")
    if (first.stdout, first.stderr) != (second.stdout, second.stderr):
        parts.append("output")
    if first.fuel_used != second.fuel_used:
        parts.append(f"fuel ({first.fuel_used:,} vs {second.fuel_used:,})")
    return ", ".join(parts)


def _replay(code: str, entry: str, failure: _Finding, path: str | None,
            replay_dir: Path, limits: Limits | None, clock: str, mounts: Any = (),
            package_flags: Sequence[str] = ()) -> str:
    """Save ``failure``'s example (and, without ``path``, the code) under ``replay_dir``;
    return the short ``wasibox fuzz ... --replay-file`` line that reruns it."""
    replay_dir.mkdir(parents=True, exist_ok=True)
    if path is None:
        source = replay_dir / f"{entry}.py"
        source.write_text(code, encoding="utf-8")
        path = str(source)
    example = replay_dir / f"{entry}-{failure.kind}.txt"
    # A Python literal tuple, as --replay takes it; ascii() keeps the file plain text.
    example.write_text(ascii(failure.example) + "\n", encoding="ascii")
    # The mounts the code imports its own modules from (a scratch mount has no host side;
    # one whose path holds ':' has no --mount form, and the line then goes without it).
    granted = []
    for mount in mounts:
        with contextlib.suppress(UsageError):
            granted.append(format_mount(mount))
    command = ["wasibox", "fuzz", path, "--entry", entry,
               *(part for text in granted for part in ("--mount", text)), *package_flags,
               "--replay-file", str(example)]
    if limits is not None and limits != Limits():
        # The defaults may not reproduce a limit failure: name every limit the run had.
        command += ["--fuel", str(limits.fuel), "--memory", str(limits.memory_bytes),
                    "--timeout", str(limits.timeout_s),
                    "--output-bytes", str(limits.output_bytes)]
    if clock == "real":
        command.append("--real-clock")
    return shlex.join(command)


def replay(code: str, entry: str, arguments: str, **options: Any) -> RunResult:
    """Run ``entry`` once with ``arguments``, a Python literal tuple (as ``fuzz`` saves it).

    Raises UsageError when ``arguments`` is not such a literal (see ``read_example``).
    """
    return GuestFunction(code, entry, **options).run(*read_example(arguments))


def read_example(text: str) -> tuple[Any, ...]:
    """The arguments in ``text``, a Python literal (a tuple, or one value) as ``fuzz`` saves
    it; ``inf`` and ``nan`` are read as floats, as ``repr`` writes them.

    Raises UsageError when ``text`` is not such a literal.
    """
    try:
        values = ast.literal_eval(_FloatNames().visit(parse(text.strip(), "eval")))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise UsageError(f"--replay takes a Python literal tuple of arguments: {exc}") \
            from None
    return values if isinstance(values, tuple) else (values,)


class _FloatNames(ast.NodeTransformer):
    """Reads the names ``inf`` and ``nan`` in a literal as the floats ``repr`` wrote."""

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node
