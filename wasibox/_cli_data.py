"""The ``wasibox transform`` and ``wasibox fuzz`` commands, and the record formats they read.

Formats are chosen by file extension: ``.jsonl`` / ``.ndjson`` (JSON Lines), ``.csv`` (a
header row, then one record per row; every value is a string), ``.msgpack`` / ``.mpk`` (a
stream of msgpack objects). ``-`` means stdin / stdout as JSON Lines.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, Literal

import msgpack

from ._batch import batch_elements, decode_batch_reply, encode_records
from ._errors import UsageError
from ._limits import Limits
from ._select import parse
from ._transform import BATCH_REPLY_LIMIT, DEFAULT_BATCH_SIZE
from ._wire import ProtocolError
from .capabilities.files.mount import MOUNT_METAVAR, parse_mount

__all__ = ["FORMATS", "add_commands", "format_of", "package_arguments", "package_options",
           "read_records", "write_records"]

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".msgpack": "msgpack",
           ".mpk": "msgpack"}

_TRANSFORM_EPILOG = """\
formats (chosen by extension): .jsonl/.ndjson (JSON Lines), .csv (header row; values are
strings; the output's columns are the keys of the first output record), .msgpack/.mpk (a
stream of msgpack objects). '-' is stdin/stdout as JSON Lines.

Progress goes to stderr (a bar on a terminal); at the end, stderr gets the record count,
records/s and the total fuel burnt.

OUTPUT is written to a temporary file beside it and renamed over it only when every record
has been written: a failed or interrupted run leaves no partial output (and an existing
OUTPUT as it was).

exit status: 0 on success, 1 if a record failed (with --on-error raise), 2 if wasibox could
not run (bad arguments, unreadable files, CODE_FILE defines no function ENTRY).

examples:
  wasibox transform clean.py --entry transform orders.csv cleaned.jsonl
  wasibox transform score.py in.msgpack out.msgpack --batch-size 5000 --on-error skip
"""

_FUZZ_EPILOG = """\
Arguments are drawn from the entry function's type annotations (read from the source, never
executed on the host). Every example runs twice, each time in a fresh sandbox; guest
exceptions, exceeded limits and runs that differ (nondeterminism) are failures, reported
with the shrunk example and a replay command. Fuel is a hypothesis target, so slow inputs
surface in the fuel line of the report.

exit status: 0 if nothing failed, 1 if something did, 2 if wasibox could not run.

examples:
  wasibox fuzz parser.py --entry parse --max-examples 500
  wasibox fuzz parser.py --entry parse --replay-file failure-1.json
"""


def format_of(path: str) -> str:
    """The record format of ``path`` by its extension; raises UsageError if unknown."""
    if path == "-":
        return "jsonl"
    extension = os.path.splitext(path)[1].lower()
    if extension not in FORMATS:
        raise UsageError(f"cannot tell the format of {path!r}: use one of "
                         f"{', '.join(sorted(FORMATS))}")
    return FORMATS[extension]


def read_records(handle: IO[bytes], fmt: str) -> Iterator[Any]:
    """Yield records from a binary stream, lazily; raises UsageError for malformed input."""
    if fmt == "msgpack":
        unpacker = msgpack.Unpacker(handle, raw=False, strict_map_key=False)
        try:
            yield from unpacker
        except (ValueError, msgpack.UnpackException) as exc:
            raise UsageError(f"the input is not a valid msgpack stream: {exc}") from None
        return
    text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
    if fmt == "csv":
        yield from csv.DictReader(text)
        return
    for number, line in enumerate(text, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise UsageError(f"line {number} of the input is not JSON: {exc}") from None


def write_records(handle: IO[bytes], fmt: str, records: Iterable[Any]) -> int:
    """Write records to a binary stream; returns how many. Raises UsageError for a record
    the format cannot hold."""
    count = 0
    if fmt == "msgpack":
        packer = msgpack.Packer(use_bin_type=True)
        for count, record in enumerate(records, 1):
            try:
                handle.write(packer.pack(record))
            except (TypeError, ValueError, OverflowError) as exc:
                raise UsageError(f"output record {count - 1} cannot be msgpack: {exc}") \
                    from None
        return count
    text = io.TextIOWrapper(handle, encoding="utf-8", newline="", write_through=True)
    try:
        if fmt == "csv":
            writer: csv.DictWriter[str] | None = None
            for count, record in enumerate(records, 1):
                if not isinstance(record, dict):
                    raise UsageError(f"output record {count - 1} is a "
                                     f"{type(record).__name__}; CSV needs dicts")
                if writer is None:
                    writer = csv.DictWriter(text, fieldnames=list(record))
                    writer.writeheader()
                try:
                    writer.writerow(record)
                except ValueError as exc:
                    raise UsageError(f"output record {count - 1} does not fit the CSV "
                                     f"columns {writer.fieldnames}: {exc}") from None
            return count
        for count, record in enumerate(records, 1):
            try:
                text.write(json.dumps(record, ensure_ascii=False) + "\n")
            except (TypeError, ValueError) as exc:
                raise UsageError(f"output record {count - 1} cannot be JSON: {exc}") from None
        return count
    finally:
        text.detach()


def package_arguments(parser: argparse.ArgumentParser) -> None:
    """``--package`` (repeatable) and where pip finds packages, for a command's sandbox."""
    group = parser.add_argument_group(
        "packages (pure-Python wheels, built into the guest's snapshot once per set)")
    group.add_argument("--package", action="append", default=[], metavar="REQUIREMENT",
                       dest="packages",
                       help="a package for the guest, such as 'attrs' or 'pyyaml==6.0.2', "
                            "resolved with pip (wheels only: no package code runs on this "
                            "machine); repeatable")
    group.add_argument("--find-links", action="append", default=[], metavar="DIR",
                       help="also look for wheels in DIR (a wheelhouse); repeatable")
    group.add_argument("--index-url", metavar="URL",
                       help="the package index to use instead of pip's configured one")
    group.add_argument("--no-index", action="store_true",
                       help="use only --find-links, no package index")


def package_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Sandbox option ``packages`` from ``package_arguments``' flags (none if none)."""
    if not args.packages:
        if args.find_links or args.index_url or args.no_index:
            raise UsageError("--find-links, --index-url and --no-index say where to find "
                             "packages: add the packages with --package")
        return {}
    from ._packages import Packages

    return {"packages": Packages(requirements=tuple(args.packages), index_url=args.index_url,
                                 find_links=tuple(args.find_links), no_index=args.no_index)}


def add_commands(commands: Any, limits_arguments: Any) -> None:
    """Add ``transform`` and ``fuzz`` to the CLI's subcommands."""
    transform = commands.add_parser(
        "transform", help="apply a Python function to every record of a file, sandboxed",
        description="Apply the function ENTRY of CODE_FILE to every record of INPUT, in "
                    "batches, each batch in a fresh sandbox, and write the outputs to OUTPUT "
                    "in order.", epilog=_TRANSFORM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    transform.add_argument("code_file", metavar="CODE_FILE", help="Python file defining ENTRY")
    transform.add_argument("input", metavar="INPUT", help="records to read ('-' for stdin)")
    transform.add_argument("output", metavar="OUTPUT", help="where to write ('-' for stdout)")
    transform.add_argument("--entry", default="transform",
                           help="the function to apply (default: %(default)s)")
    transform.add_argument("--batch-size", type=_batch_size, default=DEFAULT_BATCH_SIZE,
                           help="records per sandbox instance, or 'auto': sized from the "
                                "fuel and bytes of the first batches (default: %(default)s)")
    transform.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                           help="stop at the first failed record, or skip failed records "
                                "(default: %(default)s)")
    transform.add_argument("--seed", type=int, default=0,
                           help="seed for the guest's random module and entropy "
                                "(default: %(default)s)")
    transform.add_argument("--no-progress", action="store_true",
                           help="no progress bar, even on a terminal")
    _mount_argument(transform, "CODE_FILE")
    package_arguments(transform)
    limits_arguments(transform)
    transform.set_defaults(handler=_cmd_transform)

    fuzz = commands.add_parser(
        "fuzz", help="fuzz a guest function with hypothesis, a fresh sandbox per example",
        description="Fuzz the function ENTRY of FILE with arguments drawn from its type "
                    "annotations.", epilog=_FUZZ_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    fuzz.add_argument("file", metavar="FILE", help="Python file defining ENTRY")
    fuzz.add_argument("--entry", default="transform",
                      help="the function to fuzz (default: %(default)s)")
    fuzz.add_argument("--max-examples", type=int, default=100,
                      help="examples to try (default: %(default)s)")
    fuzz.add_argument("--seed", type=int, default=0,
                      help="seeds the search, so a run can be repeated (default: 0)")
    fuzz.add_argument("--real-clock", action="store_true",
                      help="grant the host's real clock (fuzzing then finds nondeterminism)")
    fuzz.add_argument("--no-target", action="store_true",
                      help="do not steer the search towards examples that burn more fuel")
    replay = fuzz.add_mutually_exclusive_group()
    replay.add_argument("--replay", metavar="ARGS",
                        help="run once with these arguments (a Python literal tuple) and "
                             "print the result as JSON, instead of fuzzing")
    replay.add_argument("--replay-file", metavar="EXAMPLE",
                        help="the same, with the arguments read from a file a failure's "
                             "replay line names")
    fuzz.add_argument("--replay-dir", metavar="DIR",
                      help="where to save each failure's example for its replay line "
                           "(default: a new temporary directory)")
    _mount_argument(fuzz, "FILE")
    package_arguments(fuzz)
    limits_arguments(fuzz)
    fuzz.set_defaults(handler=_cmd_fuzz)


def _batch_size(text: str) -> int | Literal["auto"]:
    """``--batch-size``: a positive count of records, or "auto"."""
    if text == "auto":
        return "auto"
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a positive number of records or 'auto': {text!r}")
    return size


def _mount_argument(parser: argparse.ArgumentParser, script: str) -> None:
    parser.add_argument("--mount", action="append", default=[], metavar=MOUNT_METAVAR,
                        help=f"show host directory HOST to the guest at GUEST, as for wasibox "
                             f"run; when a mount holds {script}, its directory comes first on "
                             f"the guest's sys.path, so its own modules import; repeatable")


def _script_options(path: str, mount_texts: list[str]) -> dict[str, Any]:
    """The Sandbox options of ``--mount``: the mounts, and the script's guest directory
    first on ``sys.path`` (as ``python script.py`` puts it) if a mount shows the script."""
    if not mount_texts:
        return {}
    from .capabilities.files.mount import guest_path_for

    mounts = [parse_mount(text) for text in mount_texts]
    guest = guest_path_for(path, mounts)
    return {"mounts": mounts,
            "python_path": [guest.rpartition("/")[0] or "/"] if guest is not None else []}


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(fuel=args.fuel, memory_bytes=args.memory, timeout_s=args.timeout,
                  output_bytes=args.output_bytes)


def _read_code(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


@contextlib.contextmanager
def _open(path: str) -> Iterator[IO[bytes]]:
    """INPUT opened for reading (``-``: stdin); raises UsageError if it cannot be."""
    if path == "-":
        yield sys.stdin.buffer
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror}") from None
    with handle:
        yield handle


@contextlib.contextmanager
def _atomic_output(path: str) -> Iterator[IO[bytes]]:
    """OUTPUT to write (``-``: stdout): a temporary file beside ``path``, renamed over it
    only when the block ends without an exception, and removed otherwise.

    A failed run so leaves no partial output, and an existing file as it was. Raises
    UsageError when the directory cannot take the file.
    """
    if path == "-":
        yield sys.stdout.buffer
        return
    directory, name = os.path.split(os.path.abspath(path))
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=directory)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        mask = os.umask(0o22)  # mkstemp makes 0600; give OUTPUT what open() would
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as handle:
            yield handle
        try:
            os.replace(temporary, path)
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _check_entry(transform: Any, code: str, entry: str, code_file: str) -> None:
    """Raise UsageError if ``code`` defines no ``entry``, before any record runs.

    Most code binds its entry in plain sight (``def``, assignment, import): then nothing
    runs here. Otherwise the code runs once in the sandbox with no records, and a guest
    that reports the entry missing is taken at its word (at worst, a usage error).
    """
    try:
        tree = parse(code)
    except (SyntaxError, ValueError):
        return  # the run reports it, with the guest's own traceback
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                and node.name == entry:
            return
        if isinstance(node, ast.Name) and node.id == entry and \
                isinstance(node.ctx, ast.Store):
            return
        if isinstance(node, ast.alias) and \
                (node.asname or node.name.partition(".")[0]) in (entry, "*"):
            return
    outcome = transform._sandbox._execute_batch(code, entry, encode_records([]))
    if outcome.reply is None or outcome.limit_exceeded is not None:
        return  # the run below reports it
    try:
        reply = decode_batch_reply(outcome.reply, 0, BATCH_REPLY_LIMIT,
                                   batch_elements(transform.spec.limits.memory_bytes, 0))
    except ProtocolError:
        return
    if reply.error is not None and reply.error.get("type") == "NameError" and \
            reply.error.get("message") == f"the code defines no callable named {entry!r}":
        defined = sorted(node.name for node in tree.body
                         if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
        hint = (f"; it defines {', '.join(defined)}" if defined else
                "; it defines no top-level function")
        raise UsageError(f"{code_file} defines no function named {entry!r} (--entry){hint}")


def _cmd_transform(args: argparse.Namespace) -> int:
    from ._errors import GuestError, LimitExceeded
    from ._transform import Transform, progress_bar

    code = _read_code(args.code_file)
    in_format, out_format = format_of(args.input), format_of(args.output)
    transform = Transform(code, args.entry, limits=_limits(args), seed=args.seed,
                          on_error=args.on_error, batch_size=args.batch_size,
                          **_script_options(args.code_file, args.mount),
                          **package_options(args))
    try:
        _check_entry(transform, code, args.entry, args.code_file)
    except BaseException:
        transform.close()
        raise
    show_bar = not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    done = [0, 0]

    def progress(state: Any) -> None:
        done[:] = [state.done, state.failed]
        if show_bar:
            bar(state)

    bar = progress_bar(sys.stderr)
    try:
        with _open(args.input) as source, _atomic_output(args.output) as sink:
            outputs = transform.imap(read_records(source, in_format), progress=progress)
            written = write_records(sink, out_format, outputs)
    except (GuestError, LimitExceeded) as exc:
        if show_bar:
            sys.stderr.write("\n")
        print(f"wasibox: {exc}", file=sys.stderr)
        if isinstance(exc, GuestError) and exc.traceback:
            sys.stderr.write(exc.traceback)
        return 1
    finally:
        transform.close()
    elapsed = time.perf_counter() - started
    if show_bar:
        sys.stderr.write("\n")
    skipped = f", {done[1]} failed and skipped" if done[1] else ""
    print(f"wasibox: {done[0]} records -> {written} written in {elapsed:.2f}s "
          f"({done[0] / elapsed if elapsed else 0:,.0f} records/s), "
          f"fuel {transform.fuel_used:,}{skipped}", file=sys.stderr)
    return 0


def _cmd_fuzz(args: argparse.Namespace) -> int:
    from .testing import fuzz, replay

    code = _read_code(args.file)
    clock: Literal["virtual", "real"] = "real" if args.real_clock else "virtual"
    if args.replay_file is not None:
        args.replay = _read_code(args.replay_file)
    options = {**_script_options(args.file, args.mount), **package_options(args)}
    if args.replay is not None:
        result = replay(code, args.entry, args.replay, limits=_limits(args), clock=clock,
                        **options)
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    report = fuzz(code, args.entry, max_examples=args.max_examples, seed=args.seed,
                  limits=_limits(args), clock=clock, target_fuel=not args.no_target,
                  path=args.file, replay_dir=args.replay_dir, **options)
    print(report)
    return 0 if report.ok else 1
