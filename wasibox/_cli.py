"""The ``wasibox`` command line: run code, prepare the guest, check the installation."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from ._errors import EmulationRefused, UsageError, WasiboxError, fuel_advice
from ._journal import DEFAULT_JOURNAL_BYTES
from ._limits import FUEL_PER_SECOND, Limit, Limits, parse_size
from ._terminal import inert
from ._version import __version__
from .capabilities.files.mount import MOUNT_METAVAR, guest_path_for, parse_mount, parse_scratch

__all__ = ["main"]

#: Exit status when a run exceeded a limit (the same as timeout(1)).
EXIT_LIMIT = 124
#: Exit status when wasibox itself could not run the code (bad usage, broken install).
EXIT_WASIBOX_ERROR = 2

_DESCRIPTION = """\
Run untrusted Python in a CPython interpreter compiled to WebAssembly.

Each run gets a fresh interpreter with nothing granted: no files, no network, no host
environment, a virtual clock and seeded entropy. CPU (fuel), wall-clock time, memory and
output are capped.
"""

#: How a command line allows the microVM to run under software emulation.
_EMULATION_OPT_IN = "--allow-emulation (wasibox run) or WASIBOX_ALLOW_EMULATION=1"

_RUN_EPILOG = """\
exit status:
  the guest's own exit status, or 124 if it exceeded a limit (the limit is named on
  stderr), or 2 if wasibox could not run it.

examples:
  wasibox run script.py
  wasibox run -c 'print(sum(range(10)))'
  wasibox run --timeout 1 --json -c 'while True: pass'
  wasibox run --mount ./data:/data --mount ./out:/out:rw --scratch /tmp report.py
  wasibox run --mount ./out:/out:rw,c_access orders.py
      (C code in the guest, such as sqlite3.connect('/out/shop.db'), sees /out too)
  wasibox run --mount ./proj:/src proj/main.py --verbose < input.csv
      (main.py imports its own modules: the script's directory comes first on sys.path;
      arguments after the script are its sys.argv[1:], and it reads this stdin)
"""


def _limits_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    group = parser.add_argument_group("limits")
    group.add_argument("--fuel", type=int, default=None,
                       help="CPU budget in fuel units, deterministic (default: enough for the "
                            f"whole timeout: {FUEL_PER_SECOND:,} per second of --timeout)")
    group.add_argument("--memory", default=defaults.memory_bytes, metavar="BYTES",
                       help="memory cap, e.g. 268435456 or 256MiB (default: %(default)s)")
    group.add_argument("--timeout", type=float, default=defaults.timeout_s, metavar="SECONDS",
                       help="wall-clock limit (default: %(default)s)")
    group.add_argument("--output-bytes", default=defaults.output_bytes, metavar="BYTES",
                       help="cap on stdout+stderr; the run stops past it (default: %(default)s)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wasibox", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"wasibox {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run", help="run a Python file or a code string in a fresh sandbox",
        description="Run Python code in a fresh sandbox and relay its output.",
        epilog=_RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("file", nargs="?", help="the Python file to run ('-' for stdin)")
    source.add_argument("-c", dest="code", metavar="CODE", help="the code to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARG",
                     help="arguments for the script: its sys.argv[1:]")
    _limits_arguments(run)
    run.add_argument("--seed", type=int, default=0,
                     help="seed for the guest's random module and entropy (default: 0)")
    run.add_argument("--real-clock", action="store_true",
                     help="grant the host's real clock instead of the virtual one")
    run.add_argument("--real-entropy", action="store_true",
                     help="grant the host's OS entropy instead of the seeded stream")
    run.add_argument("--backend", choices=("auto", "wasm", "microvm"), default="auto",
                     help="where to run: wasm, the microVM (numpy, pandas, ...), or auto: "
                          "wasm unless the code imports what only the microVM has "
                          "(default: %(default)s)")
    run.add_argument("--allow-emulation", action="store_true", default=None,
                     help="let the microVM run under software emulation (TCG) where KVM "
                          "is not usable; TCG is not a security boundary")
    run.add_argument("--json", action="store_true",
                     help="print the whole result as JSON instead of relaying output")
    files = run.add_argument_group("files (the guest has none unless granted)")
    files.add_argument("--mount", action="append", default=[], metavar=MOUNT_METAVAR,
                       help="show host directory HOST to the guest at GUEST, read-only unless "
                            "':rw' is added (then its changes are published only if the run "
                            "ends ok); ':rw,c_access' also shows it to C code in the guest, "
                            "such as sqlite3 (a private copy of its files per run); "
                            "repeatable")
    files.add_argument("--scratch", metavar="GUEST[:c_access]",
                       help="a private, empty, writable directory at GUEST (e.g. /tmp), "
                            "thrown away after the run; ':c_access' shows it to C code too")
    program = run.add_argument_group("the program's input (none of the host's unless given)")
    program.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                         help="set NAME in the guest's os.environ, to VALUE or to this "
                              "process's own value of NAME; repeatable")
    program.add_argument("--no-stdin", action="store_true",
                         help="give the guest an empty stdin; by default it reads this "
                              "command's stdin to its end, unless that is a terminal")
    from ._cli_data import package_arguments  # beside transform and fuzz, which take it too

    package_arguments(run)
    record = run.add_argument_group("journal (see docs/journal.md)")
    record.add_argument("--journal", metavar="FILE",
                        help="record the run into FILE (JSON Lines): its code, input and "
                             "every value the host handed the guest, so that 'wasibox "
                             "replay FILE' re-executes it offline")
    record.add_argument("--journal-bytes", default=DEFAULT_JOURNAL_BYTES, metavar="BYTES",
                        help="the most the journal may hold; past it the journal is marked "
                             "truncated and cannot be replayed (default: %(default)s)")
    run.set_defaults(handler=_cmd_run)

    replay = commands.add_parser(
        "replay", help="re-execute a recorded journal offline and check its outputs",
        description="Re-execute the runs of a journal ('wasibox run --journal FILE',\n"
                    "Sandbox.run(journal=...)) with no network, no mounts and no host\n"
                    "functions: every value the host once handed the guest is served from\n"
                    "the journal. Checks that stdout, stderr, the value or error, the exit\n"
                    "status and the fuel are identical, call by call.",
        epilog="exit status:\n  0 if every call matched, 1 if one differed (the difference "
               "is on stderr),\n  2 if the journal cannot be replayed here (malformed, "
               "truncated, or\n  recorded by another guest).\n\nexample:\n"
               "  wasibox run --journal failure.jsonl job.py\n"
               "  wasibox replay failure.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("journal", metavar="JOURNAL", help="the journal file")
    replay.add_argument("--max-bytes", default=DEFAULT_JOURNAL_BYTES, metavar="BYTES",
                        help="refuse a larger journal file (default: %(default)s)")
    replay.add_argument("--json", action="store_true",
                        help="print each replayed result and its differences as JSON")
    replay.add_argument("--show-output", action="store_true",
                        help="relay each replayed call's stdout and stderr")
    replay.set_defaults(handler=_cmd_replay)

    prepare = commands.add_parser(
        "prepare", help="build and compile the guest now, so the first run is fast",
        description="Build the guest component (about 20 s) and compile it for this machine "
                    "(about 10-30 s), with progress. Both are cached; running this again is "
                    "instant. With --package, build the guest for that package set instead "
                    "(resolved with pip; a minute or two, once per set).",
        epilog="example:\n  wasibox prepare --package attrs --package 'pyyaml==6.0.2' "
               "--find-links ./wheelhouse",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    package_arguments(prepare)
    prepare.set_defaults(handler=_cmd_prepare)

    serve = commands.add_parser(
        "serve", help="serve runs over HTTP to tenants defined in a config file",
        description="Serve POST /v1/run and /v1/call (JSON in, RunResult out), GET /healthz, "
                    "GET /metrics (Prometheus) and /openapi.json, with uvicorn. Every /v1/ "
                    "request needs a tenant's bearer token; each tenant has its own limits, "
                    "grants, concurrency, queue and rate limit (see the README's "
                    "'wasibox serve' section for the config file). Logs one JSON line per run "
                    "on stderr.",
        epilog="example:\n  wasibox serve --config wasibox.toml --host 127.0.0.1 --port 8080\n"
               "  printf %s \"$TOKEN\" | sha256sum    # the token_sha256 of a tenant",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", required=True, metavar="FILE",
                       help="the TOML configuration (tenants, tokens, limits)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8080,
                       help="port to listen on; 0 picks a free one (default: %(default)s)")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"],
                       help="level of the per-run log lines (default: %(default)s)")
    serve.set_defaults(handler=_cmd_serve)

    mcp = commands.add_parser(
        "mcp", help="serve run_python and workspace file tools to AI agents over MCP",
        description="Serve the Model Context Protocol tools run_python, reset, write_file,\n"
                    "read_file and list_files. With no options the policy is safe as it\n"
                    "stands: default limits, no network, no host functions, no mounts.\n"
                    "--config adds the policy of one tenant of a 'wasibox serve' config file\n"
                    "(limits, mounts, HTTP allowlist, host functions, backend; no token\n"
                    "needed); tool arguments cannot change it. Each MCP session gets its own\n"
                    "workspace at /workspace, deleted when the session ends or sits idle, and\n"
                    "one live interpreter: run_python calls share its variables until 'reset'\n"
                    "(a tenant's sessions.enabled = false makes every call fresh). When the\n"
                    "tenant lists host functions, a call_function tool calls them with JSON\n"
                    "arguments under the same host-call limits.\n"
                    "Needs the 'mcp' extra: pip install 'wasibox[mcp]'.",
        epilog="examples:\n  wasibox mcp                                        # stdio, defaults\n"
               "  wasibox mcp --config wasibox.toml                  # stdio\n"
               "  wasibox mcp --config wasibox.toml --transport http --port 8765\n"
               "The HTTP transport has no authentication, so it listens only on a loopback\n"
               "address; put an authenticating proxy in front to reach it from elsewhere.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    mcp.add_argument("--config", metavar="FILE",
                     help="the TOML configuration, the same format as 'wasibox serve' "
                          "(default: none, the safe defaults above)")
    mcp.add_argument("--tenant", metavar="NAME",
                     help="whose policy to apply (default: the file's only tenant)")
    mcp.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                     help="stdio for a client that starts the server, or streamable HTTP "
                          "(default: %(default)s)")
    mcp.add_argument("--host", default="127.0.0.1",
                     help="HTTP address to listen on, a loopback one (default: %(default)s)")
    mcp.add_argument("--port", type=int, default=8765,
                     help="HTTP port to listen on (default: %(default)s)")
    mcp.add_argument("--idle-timeout", type=float, default=1800.0, metavar="SECONDS",
                     help="delete a session's workspace after this long unused "
                          "(default: %(default)s)")
    mcp.set_defaults(handler=_cmd_mcp)

    doctor = commands.add_parser(
        "doctor", help="report versions, the guest's state and what this machine supports",
        description="Report the Python, wasmtime and componentize-py versions, the guest "
                    "digest and cache state, and KVM availability. Never builds anything.")
    doctor.set_defaults(handler=_cmd_doctor)

    reference = commands.add_parser(
        "config-reference",
        help="print the reference of every configuration key (Markdown)",
        description="Print the reference of every key of the configuration file that "
                    "'wasibox serve' and 'wasibox mcp' read, generated from the models that "
                    "parse it: its type, default, bounds and meaning.")
    reference.set_defaults(handler=_cmd_config_reference)

    from .backends.microvm.cli import add_microvm_command

    add_microvm_command(commands)

    from ._cli_data import add_commands  # transform and fuzz

    add_commands(commands, _limits_arguments)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wasibox`` command; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except EmulationRefused:
        # Said for this command line, not for the Python API.
        print(f"wasibox: error: {EmulationRefused(_EMULATION_OPT_IN)}", file=sys.stderr)
        return EXIT_WASIBOX_ERROR
    except WasiboxError as exc:
        print(f"wasibox: error: {exc}", file=sys.stderr)
        return EXIT_WASIBOX_ERROR
    except KeyboardInterrupt:
        return 130
    return status


def _cmd_run(args: argparse.Namespace) -> int:
    from ._cli_data import package_options
    from ._sandbox import STDIN_LIMIT_FACTOR, Sandbox

    if args.code is not None:
        code = args.code
    elif args.file == "-":
        code = sys.stdin.read()
    else:
        try:
            with open(args.file, encoding="utf-8") as handle:
                code = handle.read()
        except OSError as exc:
            print(f"wasibox: error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
            return EXIT_WASIBOX_ERROR
    limits = Limits(fuel=args.fuel, memory_bytes=args.memory, timeout_s=args.timeout,
                    output_bytes=args.output_bytes)
    mounts = [parse_mount(text) for text in args.mount]
    if args.scratch:
        mounts.append(parse_scratch(args.scratch))
    filename, python_path = None, []
    if args.code is None and args.file != "-":
        # As `python script.py` does: the script's own directory first on sys.path, when
        # the guest can see it, and the script named in tracebacks as the guest sees it.
        filename = guest_path_for(args.file, mounts)
        if filename is not None:
            python_path.append(filename.rpartition("/")[0] or "/")
        else:
            filename = os.path.basename(args.file)
    stdin = None
    if not args.no_stdin and args.file != "-" and sys.stdin is not None \
            and not sys.stdin.isatty():
        # One byte past what a run accepts is enough for the Sandbox to refuse it clearly.
        stdin = sys.stdin.buffer.read(STDIN_LIMIT_FACTOR * limits.source_bytes + 1)
    journal = None
    if args.journal is not None:
        from ._journal import Journal

        journal = Journal(max_bytes=parse_size(args.journal_bytes, "--journal-bytes"))
    with Sandbox(limits, seed=args.seed, clock="real" if args.real_clock else "virtual",
                 entropy="real" if args.real_entropy else "seeded", mounts=mounts,
                 backend=args.backend, allow_emulation=args.allow_emulation,
                 python_path=python_path, **package_options(args)) as sandbox:
        argv0 = filename or ("-c" if args.code is not None else "-")
        result = sandbox.run(code, stdin=stdin, filename=filename, env=_env(args.env),
                             argv=[argv0, *args.script_args], journal=journal)
    if journal is not None:
        try:
            journal.save(args.journal)
        except OSError as exc:
            print(f"wasibox: error: cannot write the journal {args.journal}: {exc.strerror}",
                  file=sys.stderr)
            return EXIT_WASIBOX_ERROR
        if journal.truncated:
            print(f"wasibox: the journal passed --journal-bytes {journal.max_bytes} and was "
                  "truncated: it cannot be replayed", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _relay(sys.stdout, result.stdout)
        sys.stdout.flush()
        _relay(sys.stderr, result.stderr)
        if result.error is not None:
            _relay(sys.stderr, result.error.traceback
                   or f"{result.error.type}: {result.error.message}\n")
    if result.limit_exceeded is not None:
        if not args.json:
            words = (fuel_advice(result.fuel_used) if result.limit_exceeded == Limit.FUEL
                     else f"the run exceeded its {result.limit_exceeded.value} limit")
            print(f"wasibox: {words}", file=sys.stderr)
        return EXIT_LIMIT
    return result.exit_code


def _cmd_replay(args: argparse.Namespace) -> int:
    from ._replay import replay

    report = replay(args.journal, check=False,
                    max_bytes=parse_size(args.max_bytes, "--max-bytes"))
    if args.json:
        print(json.dumps({"ok": report.ok, "calls": [
            {"result": result.to_dict(), "differences": list(lines)}
            for result, lines in zip(report.results, report.differences, strict=True)]},
            indent=2))
    for index, (result, lines) in enumerate(zip(report.results, report.differences,
                                                strict=True)):
        if args.show_output and not args.json:
            _relay(sys.stdout, result.stdout)
            sys.stdout.flush()
            _relay(sys.stderr, result.stderr)
        if not args.json:
            verdict = "matches" if not lines else "DIFFERS"
            print(f"call {index}: {verdict} (fuel_used={result.fuel_used:,}, "
                  f"exit status {result.exit_code})", file=sys.stderr)
    if not report.ok:
        _relay(sys.stderr, report.diff() + "\n")
        print("wasibox: the replay differs from the journal", file=sys.stderr)
        return 1
    return 0


def _relay(stream: TextIO, guest_text: str) -> None:
    """Write guest text; to a terminal only with its control sequences made inert."""
    stream.write(inert(guest_text) if stream.isatty() else guest_text)


def _env(items: Sequence[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` (or ``NAME``: this process's own value) as the guest's
    environment; UsageError for a NAME this process does not have."""
    env = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals:
            if name not in os.environ:
                raise UsageError(f"--env {name}: this process has no {name} to pass; "
                                 f"give a value with --env {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return env


def _cmd_prepare(args: argparse.Namespace) -> int:
    from ._cli_data import package_options
    from ._guest import ensure_guest
    from ._packages import resolve
    from ._progress import stderr_reporter
    from .backends.wasm.runtime import runtime

    report = stderr_reporter(min_interval_s=2.0)
    started = time.perf_counter()
    wanted = package_options(args).get("packages")
    package_set = resolve(wanted, report) if wanted is not None else None
    artifact = ensure_guest(report, package_set)
    rt = runtime(progress=report, artifact=artifact if package_set is not None else None)
    report(f"ready in {time.perf_counter() - started:.1f}s")
    print(f"guest sha256 {artifact.digest}")
    print(f"guest minimum memory {rt.min_memory_bytes} bytes")
    if package_set is not None:
        print(f"package set {package_set.digest}: {', '.join(package_set.pins)}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .services.serve import serve

    try:
        return serve(args.config, args.host, args.port, log_level=args.log_level)
    except OSError as exc:
        print(f"wasibox: error: cannot listen on {args.host}:{args.port}: {exc.strerror}",
              file=sys.stderr)
        return EXIT_WASIBOX_ERROR


def _cmd_mcp(args: argparse.Namespace) -> int:
    try:
        import mcp.server.mcpserver  # noqa: F401 - the optional extra
    except ImportError as exc:
        print(f"wasibox: error: 'wasibox mcp' needs the mcp package ({exc}); "
              "install it with: pip install 'wasibox[mcp]'", file=sys.stderr)
        return EXIT_WASIBOX_ERROR
    from .services.mcp import serve_mcp

    try:
        return serve_mcp(args.config, tenant=args.tenant, transport=args.transport,
                         host=args.host, port=args.port, idle_timeout_s=args.idle_timeout)
    except OSError as exc:
        print(f"wasibox: error: cannot listen on {args.host}:{args.port}: {exc.strerror}",
              file=sys.stderr)
        return EXIT_WASIBOX_ERROR


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from .services.config_reference import config_reference

    sys.stdout.write(config_reference())
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ._guest import cache_dir, cached_guest_state, cached_package_guests

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    kvm = "/dev/kvm"
    if not os.path.exists(kvm):
        kvm_state = "absent (/dev/kvm does not exist)"
    elif os.access(kvm, os.R_OK | os.W_OK):
        kvm_state = ("present and accessible (/dev/kvm); whether the microVM can use it is "
                     "the 'microvm accelerator' line")
    else:
        kvm_state = "present but not accessible to this user (/dev/kvm)"
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("wasibox", __version__),
        ("wasmtime", version("wasmtime")),
        ("componentize-py", version("componentize-py")),
        ("cache", str(cache_dir())),
        ("guest", cached_guest_state()),
        *(("package set", line) for line in cached_package_guests() or ["none built"]),
        ("kvm", kvm_state),
    ]
    from .backends.microvm.cli import doctor_rows as microvm_rows
    from .backends.wasm.runtime import doctor_rows as wasm_rows

    rows += wasm_rows() + microvm_rows()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
