"""The ``wasibox transform`` and ``wasibox fuzz`` commands, and the record formats they read.

Formats are chosen by file extension: ``.jsonl`` / ``.ndjson`` (JSON Lines), ``.csv`` (a
header row, then one record per row; every value is a string), ``.msgpack`` / ``.mpk`` (a
stream of msgpack objects). ``-`` means stdin / stdout as JSON Lines.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, Literal

import msgpack

from ._errors import UsageError
from ._limits import Limits

__all__ = ["FORMATS", "add_commands", "format_of", "read_records", "write_records"]

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".msgpack": "msgpack",
           ".mpk": "msgpack"}

_TRANSFORM_EPILOG = """\
formats (chosen by extension): .jsonl/.ndjson (JSON Lines), .csv (header row; values are
strings; the output's columns are the keys of the first output record), .msgpack/.mpk (a
stream of msgpack objects). '-' is stdin/stdout as JSON Lines.

Progress goes to stderr (a bar on a terminal); at the end, stderr gets the record count,
records/s and the total fuel burnt.

exit status: 0 on success, 1 if a record failed (with --on-error raise) or the fuzzer found
a failure, 2 if wasibox could not run (bad arguments, unreadable files).

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
  wasibox fuzz parser.py --entry parse --replay "('0\\x00',)"
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
    transform.add_argument("--batch-size", type=int, default=1000,
                           help="records per sandbox instance (default: %(default)s)")
    transform.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                           help="stop at the first failed record, or skip failed records "
                                "(default: %(default)s)")
    transform.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    transform.add_argument("--no-progress", action="store_true",
                           help="no progress bar, even on a terminal")
    limits_arguments(transform)
    transform.set_defaults(handler=_cmd_transform)

    fuzz = commands.add_parser(
        "fuzz", help="fuzz a guest function with hypothesis, a fresh sandbox per example",
        description="Fuzz the function ENTRY of FILE with arguments drawn from its type "
                    "annotations.", epilog=_FUZZ_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    fuzz.add_argument("file", metavar="FILE", help="Python file defining ENTRY")
    fuzz.add_argument("--entry", required=True, help="the function to fuzz")
    fuzz.add_argument("--max-examples", type=int, default=100,
                      help="examples to try (default: %(default)s)")
    fuzz.add_argument("--seed", type=int, default=0,
                      help="seeds the search, so a run can be repeated (default: 0)")
    fuzz.add_argument("--real-clock", action="store_true",
                      help="grant the host's real clock (fuzzing then finds nondeterminism)")
    fuzz.add_argument("--no-target", action="store_true",
                      help="do not steer the search towards examples that burn more fuel")
    fuzz.add_argument("--replay", metavar="ARGS",
                      help="run once with these arguments (a Python literal tuple) and print "
                           "the result as JSON, instead of fuzzing")
    limits_arguments(fuzz)
    fuzz.set_defaults(handler=_cmd_fuzz)


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
def _open(path: str, mode: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdin.buffer if mode == "rb" else sys.stdout.buffer
        return
    try:
        handle = open(path, mode)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror}") from None
    with handle:
        yield handle


def _cmd_transform(args: argparse.Namespace) -> int:
    from ._errors import GuestError, LimitExceeded
    from ._transform import Transform, progress_bar

    code = _read_code(args.code_file)
    in_format, out_format = format_of(args.input), format_of(args.output)
    transform = Transform(code, args.entry, limits=_limits(args), seed=args.seed,
                          on_error=args.on_error, batch_size=args.batch_size)
    show_bar = not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    done = [0, 0]

    def progress(state: Any) -> None:
        done[:] = [state.done, state.failed]
        if show_bar:
            bar(state)

    bar = progress_bar(sys.stderr)
    try:
        with _open(args.input, "rb") as source, _open(args.output, "wb") as sink:
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
    if args.replay is not None:
        result = replay(code, args.entry, args.replay, limits=_limits(args), clock=clock)
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    report = fuzz(code, args.entry, max_examples=args.max_examples, seed=args.seed,
                  limits=_limits(args), clock=clock, target_fuel=not args.no_target,
                  path=args.file)
    print(report)
    return 0 if report.ok else 1
