"""Conformance: CPython's own regression tests, run in the wasm guest, one module per run.

What it does (everything is printed; nothing is asserted, and it is not part of the tests):
for each test module, a fresh ``Sandbox`` run mounts a CPython ``Lib/test`` tree read-only at
``/cpython/test``, imports ``test.<module>`` from it, runs it with ``unittest`` and reports
tests run, failures, errors and skipped. A module that cannot even be imported, or whose run
ends in a limit or a trap, gets a row saying so. The total line is the figure the README
tracks.

The test tree is not part of the guest (componentize-py's bundled standard library leaves
``test/`` out), and no registry this project uses ships the ``Lib/test`` of the guest's exact
CPython (3.14.0) on its own. The script looks, in this order, for:

1. ``--lib-test DIR`` or ``$WASIBOX_CPYTHON_LIB_TEST``: any ``Lib/test`` directory, e.g. the
   exact one from the ``Python-3.14.0.tgz`` source release;
2. ``<wasibox cache>/cpython-<guest version>/Lib/test``: the exact tree, unpacked there;
3. ``<wasibox cache>/cpython-lib-test/debian-<version>/test``: the same-minor tree from
   Debian's ``libpython3.X-testsuite`` and ``libpython3.X-stdlib`` packages (the second
   carries ``test/support``), which the script downloads there itself with ``apt-get``
   from Debian's unstable suite (the only one carrying 3.14) on the mirror the machine's
   apt sources already use, when it finds nothing else (``--no-fetch`` turns that off).

A newer patch release's tests can fail on 3.14.0 for bugs fixed since; ``--eryx`` tells those
(and the platform's limits) apart from failures wasibox adds: it runs every module in eryx
too (the same CPython 3.14.0 on WASI, run by its own ``pyeryx`` in the venv bench/latency.py
keeps), then reruns each test that failed in wasibox in eryx, and any that eryx passes in
wasibox again on its own. A test that still fails in wasibox alone is listed as
"wasibox only", which is what the conformance work drives to zero.

    python bench/conformance.py                         # the default modules, wasibox only
    python bench/conformance.py --eryx                  # with eryx's columns
    python bench/conformance.py --modules test_json test_csv --json out.json
    python bench/conformance.py --modules test_statistics --tests TestKDE --durations 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

import wasibox
from wasibox._guest import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import ensure_eryx_venv, eryx_venv  # noqa: E402

#: Modules that exercise what ordinary code uses; the platform-limited ones (threads,
#: subprocess, sockets, signals) are here too, so their rows say what the guest lacks.
DEFAULT_MODULES = (
    "test_abc", "test_argparse", "test_array", "test_base64", "test_binascii", "test_bisect",
    "test_bool", "test_bytes", "test_calendar", "test_collections", "test_contextlib",
    "test_copy", "test_csv", "test_dataclasses", "test_datetime", "test_decimal",
    "test_dict", "test_difflib", "test_enum", "test_float", "test_fractions",
    "test_functools", "test_glob", "test_grammar", "test_hashlib", "test_heapq", "test_html",
    "test_int", "test_itertools", "test_json", "test_list", "test_math", "test_operator",
    "test_pathlib", "test_pickle", "test_random", "test_re", "test_set", "test_shutil",
    "test_statistics", "test_str", "test_string", "test_struct", "test_tempfile",
    "test_textwrap", "test_tomllib", "test_typing", "test_unicodedata", "test_uuid",
    "test_zlib",
)
LIB_TEST_ENV = "WASIBOX_CPYTHON_LIB_TEST"
GUEST_ROOT = "/cpython"
MARKER = "@@wasibox-conformance@@"
#: The time limit of each run that looks for the test crashing or hanging a module: a test
#: still running after this long is taken to hang (as CPython 3.14.0's csv.Sniffer does on
#: the regular-expression backtracking tests of later 3.14 releases).
BISECT_TIMEOUT_S = 60.0

#: The guest side, the same in wasibox and eryx: a finder for the mounted ``test`` package
#: (loading it from the mount by name, whatever path-based finders the guest has), then one
#: unittest run of ``NAMES``, reported as JSON after ``MARKER``.
GUEST_PROGRAM = textwrap.dedent("""
    import collections, importlib.abc, importlib.util, io, json, os, sys, sysconfig, time
    import unittest

    class MountedTests(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
        def find_spec(self, name, path=None, target=None):
            if name != "test" and not name.startswith("test."):
                return None
            base = ROOT + "/" + name.replace(".", "/")
            if os.path.isfile(base + "/__init__.py"):
                spec = importlib.util.spec_from_loader(
                    name, self, origin=base + "/__init__.py", is_package=True)
                spec.submodule_search_locations = [base]
            elif os.path.isfile(base + ".py"):
                spec = importlib.util.spec_from_loader(name, self, origin=base + ".py")
            else:
                return None
            spec.has_location = True
            return spec

        def _path(self, name):
            base = ROOT + "/" + name.replace(".", "/")
            return base + "/__init__.py" if os.path.isdir(base) else base + ".py"

        def get_source(self, name):
            with open(self._path(name), encoding="utf-8") as handle:
                return handle.read()

        def get_code(self, name):
            return compile(self.get_source(name), self._path(name), "exec", dont_inherit=True)

        def is_package(self, name):
            return os.path.isdir(ROOT + "/" + name.replace(".", "/"))

    sys.meta_path.append(MountedTests())
    # This CPython build (the guest's and eryx's alike) records CONFIG_ARGS with its closing
    # quote cut off, and test.support shlex-splits it on import: close the quote.
    config = sysconfig.get_config_vars()
    if config.get("CONFIG_ARGS", "").count("'") % 2:
        config["CONFIG_ARGS"] += "'"
    os.chdir("/tmp")

    def summary(trace):  # the exception's first line, after the traceback's frames
        lines = trace.strip().splitlines()
        frames = [index for index, line in enumerate(lines) if line.startswith("  File ")]
        after = [line for line in lines[frames[-1] + 1 if frames else 0:]
                 if line and not line.startswith(" ")]
        return (after or lines or [""])[0][:240]

    def flat(suite):
        for test in suite:
            yield from flat(test) if isinstance(test, unittest.TestSuite) else [test]

    class Timed(unittest.TextTestResult):  # each test's time, by the guest's clock
        times = {}

        def startTest(self, test):
            self.started = time.perf_counter()
            super().startTest(test)

        def stopTest(self, test):
            super().stopTest(test)
            self.times[test.id()] = time.perf_counter() - self.started

    def report():
        try:
            tests = list(flat(unittest.defaultTestLoader.loadTestsFromName(MODULE)))
        except unittest.SkipTest as skip:  # the whole module: regrtest reports it skipped
            return {"module_skipped": str(skip)[:200]}
        # A subtest's id is its test's id and a space; ONLY lists tests' ids, or their
        # prefixes (a class's id selects its tests).
        def chosen(name, prefix):
            return name == prefix or name.startswith(prefix + ".")
        missing = [prefix for prefix in ONLY or ()
                   if not any(chosen(test.id(), prefix) for test in tests)]
        if ONLY is not None:
            tests = [test for test in tests
                     if any(chosen(test.id(), prefix) for prefix in ONLY)]
        if SLICE is not None:
            tests = tests[SLICE[0]:SLICE[1]]
        if LIST:
            return {"ids": [test.id() for test in tests]}
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0,
                                         resultclass=Timed).run(unittest.TestSuite(tests))
        failed = [[test.id(), summary(trace)] for test, trace in result.failures]
        failed += [[test.id(), "unexpected success"] for test in result.unexpectedSuccesses]
        reasons = collections.Counter(str(reason)[:120] for _, reason in result.skipped)
        return {"run": result.testsRun, "failed": failed, "skipped": len(result.skipped),
                "skipped_ids": sorted({test.id() for test, _ in result.skipped}),
                "errored": [[test.id(), summary(trace)] for test, trace in result.errors],
                "skip_reasons": reasons.most_common(8), "missing": sorted(missing),
                "slowest": sorted(Timed.times.items(), key=lambda item: -item[1])[:SLOWEST]}

    print("\\n" + MARKER + json.dumps(report()))
""")

#: Runs in the eryx venv: reads ``{"lib_test", "jobs": [[key, code, timeout_s], ...]}`` on
#: stdin and prints one JSON line per job: its stdout, or the error that ended it.
ERYX_CHILD = """\
import json, sys, tempfile
import eryx
request = json.load(sys.stdin)
for key, code, timeout_s in request["jobs"]:
    limits = eryx.ResourceLimits(execution_timeout_ms=int(timeout_s * 1000),
                                 max_memory_bytes=1 << 30)
    with tempfile.TemporaryDirectory() as scratch:
        volumes = [(request["lib_test"], "/cpython/test", True), (scratch, "/tmp", False)]
        try:
            result = eryx.Sandbox(volumes=volumes, resource_limits=limits).execute(code)
            reply = {"key": key, "stdout": result.stdout_text}
        except Exception as error:
            text = str(error).strip()
            reply = {"key": key, "timeout": isinstance(error, TimeoutError),
                     "error": type(error).__name__ + ": " + text.splitlines()[-1]
                     if text else type(error).__name__}
    print(json.dumps(reply), flush=True)
"""

ERYX_VERSION = ("import eryx; print(eryx.__version__, 'running CPython', eryx.Sandbox().execute("
                "'import sys; print(sys.version.split()[0])').stdout_text.strip())")


@dataclasses.dataclass(frozen=True)
class Job:
    """One guest run: a test module, narrowed to some test ids or a slice of its tests."""

    module: str
    only: tuple[str, ...] | None = None
    window: tuple[int, int] | None = None
    list_only: bool = False
    timeout_s: float | None = None  #: None: the runner's own
    slowest: int = 0  #: how many of the slowest tests to report, with their times

    def code(self) -> str:
        only = None if self.only is None else list(self.only)
        window = None if self.window is None else list(self.window)
        return (f"ROOT, MODULE, ONLY, SLICE, LIST, MARKER, SLOWEST = {GUEST_ROOT!r}, "
                f"{'test.' + self.module!r}, {only!r}, {window!r}, {self.list_only!r}, "
                f"{MARKER!r}, {self.slowest!r}\n" + GUEST_PROGRAM)


@dataclasses.dataclass
class Outcome:
    """One run of some tests: its counts and failing ids, or why it produced none."""

    run: int = 0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    errored: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: int = 0
    skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The ids of the tests skipped (a failure eryx skips is not one eryx passes).
    skipped_ids: set[str] = dataclasses.field(default_factory=set)
    missing: list[str] = dataclasses.field(default_factory=list)
    ids: list[str] = dataclasses.field(default_factory=list)
    #: The slowest tests and their seconds by the guest's clock, slowest first.
    slowest: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    module_skipped: str = ""
    #: Why the run produced no report: ``crashed`` if it ended in a trap, ``timed_out`` if it
    #: ran out of time; either way, running its tests in smaller groups finds the test that
    #: crashed or hung it.
    note: str = ""
    crashed: bool = False
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def completed(self) -> bool:
        return not self.note

    @property
    def bad(self) -> dict[str, str]:
        return {**self.failed, **self.errored}

    @property
    def passed(self) -> int:
        return self.run - len(self.failed) - len(self.errored) - self.skipped

    def add(self, other: Outcome) -> None:
        """Count ``other`` (a completed run of other tests of the module) in too."""
        self.run += other.run
        self.failed.update(other.failed)
        self.errored.update(other.errored)
        self.skipped += other.skipped
        self.skipped_ids |= other.skipped_ids
        for reason, number in other.skip_reasons.items():
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + number
        self.seconds += other.seconds
        keep = max(len(self.slowest), len(other.slowest))
        self.slowest = sorted(self.slowest + other.slowest, key=lambda item: -item[1])[:keep]


def parse_report(stdout: str) -> Outcome | None:
    """The guest program's JSON report from a run's stdout, or None if it printed none."""
    _, marker, tail = stdout.rpartition(MARKER)
    if not marker:
        return None
    try:
        report = json.loads(tail.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None
    if "module_skipped" in report:
        return Outcome(module_skipped=str(report["module_skipped"]))
    if "ids" in report:
        return Outcome(ids=[str(name) for name in report["ids"]])
    return Outcome(run=report["run"], failed=dict(report["failed"]),
                   errored=dict(report["errored"]), skipped=report["skipped"],
                   skip_reasons={str(r): int(n) for r, n in report["skip_reasons"]},
                   skipped_ids={str(name) for name in report.get("skipped_ids", ())},
                   missing=list(report["missing"]),
                   slowest=[(str(name), float(s)) for name, s in report.get("slowest", [])])


class Runner:
    """Runs jobs in one engine; subclasses say how."""

    name = ""

    def run(self, jobs: list[Job]) -> list[Outcome]:
        raise NotImplementedError

    def module(self, job: Job) -> Outcome:
        """The job's tests of its module; if a test crashes the interpreter or hangs, the
        other tests are still counted, and each such test is an error naming the crash or
        hang."""
        (outcome,) = self.run([job])
        if outcome.completed or not (outcome.crashed or outcome.timed_out):
            return outcome
        (listing,) = self.run([dataclasses.replace(job, list_only=True,
                                                   timeout_s=BISECT_TIMEOUT_S)])
        if not listing.completed:
            return outcome
        total = Outcome(seconds=outcome.seconds + listing.seconds)
        self._bisect(job, listing.ids, (0, len(listing.ids)), outcome.note, total)
        return total

    def _bisect(self, job: Job, ids: list[str], window: tuple[int, int], note: str,
                total: Outcome) -> None:
        start, stop = window
        if stop - start == 1:
            total.run += 1
            total.errored[ids[start]] = note
            return
        middle = (start + stop) // 2
        halves = [(start, middle), (middle, stop)]
        jobs = [dataclasses.replace(job, window=half, timeout_s=BISECT_TIMEOUT_S)
                for half in halves]
        for half, outcome in zip(halves, self.run(jobs), strict=True):
            if outcome.completed:
                total.add(outcome)
            elif outcome.crashed or outcome.timed_out:
                kind = "crashed" if outcome.crashed else "hung"
                self._bisect(job, ids, half, f"{kind}: {outcome.note}", total)
            else:  # no report for another reason: these tests count as errors, all of them
                total.run += half[1] - half[0]
                total.errored.update((name, outcome.note) for name in ids[half[0]:half[1]])


# -- the Lib/test tree ---------------------------------------------------------------------

def find_lib_test(given: str | None, version: str) -> tuple[Path, str] | None:
    """The Lib/test directory to mount and where its version comes from, or None."""
    for candidate, origin in ((given, "given with --lib-test"),
                              (os.environ.get(LIB_TEST_ENV), f"given in ${LIB_TEST_ENV}"),
                              (str(cache_dir() / f"cpython-{version}" / "Lib" / "test"),
                               f"CPython {version}, the guest's own version")):
        if candidate and (Path(candidate) / "support" / "__init__.py").is_file():
            return Path(candidate).resolve(), origin
    minor = ".".join(version.split(".")[:2])
    fetched = sorted((cache_dir() / "cpython-lib-test").glob(f"debian-{minor}.*/test"))
    for tree in reversed(fetched):
        if (tree / "support" / "__init__.py").is_file():
            return tree, debian_origin(tree.parent.name.removeprefix("debian-"), version)
    return None


def debian_origin(deb_version: str, version: str) -> str:
    upstream = deb_version.split("-")[0]
    minor = ".".join(upstream.split(".")[:2])
    return (f"CPython {upstream} (Debian's libpython{minor}-testsuite {deb_version}): the "
            f"same minor release as the guest's {version}, not the same patch release")


def debian_mirror() -> str | None:
    """The Debian archive URI the machine's apt sources already use, if any."""
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for match in re.finditer(r"(?m)^\s*(?:URIs:|deb(?:\s+\[[^\]]*\])?)\s+(\S+)", text):
            uri = match.group(1).rstrip("/")
            if uri.endswith("/debian"):
                return uri
    return None


def fetch_lib_test(version: str) -> tuple[Path, str] | str:
    """Download Debian's same-minor test suite into the cache; the tree, or why not."""
    minor = ".".join(version.split(".")[:2])
    mirror = debian_mirror()
    apt_get, dpkg_deb = shutil.which("apt-get"), shutil.which("dpkg-deb")
    keyring = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
    if mirror is None or apt_get is None or dpkg_deb is None or not keyring.is_file():
        return "this machine has no Debian apt sources, apt-get, dpkg-deb or Debian keyring"
    work = cache_dir() / "cpython-lib-test" / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "parts", "debs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "sources.list").write_text(f"deb [signed-by={keyring}] {mirror} sid main\n",
                                       encoding="utf-8")
    options = [f"-oDir::Etc::SourceList={work / 'sources.list'}",
               f"-oDir::Etc::SourceParts={work / 'parts'}",
               f"-oDir::State::Lists={work / 'lists'}", f"-oDir::Cache={work / 'cache'}"]
    packages = [f"libpython{minor}-testsuite", f"libpython{minor}-stdlib"]
    print(f"Fetching {' and '.join(packages)} from Debian unstable with apt-get "
          f"(its index once, about 10 MB, then about 8 MB of packages) into {work}",
          flush=True)
    for command in ([apt_get, *options, "update"], [apt_get, *options, "download", *packages]):
        if subprocess.run(command, cwd=work / "debs").returncode != 0:
            return f"`{' '.join(command[:1] + command[-2:])}` failed (see its output above)"
    debs = {name: sorted((work / "debs").glob(f"{name}_*.deb")) for name in packages}
    if not all(debs.values()):
        return "apt-get download left no .deb behind"
    deb_version = debs[packages[0]][-1].name.split("_")[1]
    target = work.parent / f"debian-{deb_version}"
    with tempfile.TemporaryDirectory(dir=work) as unpack:
        for name in packages:
            subprocess.run([dpkg_deb, "-x", str(debs[name][-1]), unpack], check=True)
        tree = Path(unpack) / "usr" / "lib" / f"python{minor}" / "test"
        if not (tree / "support" / "__init__.py").is_file():
            return f"the packages carry no usr/lib/python{minor}/test/support"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        tree.rename(target / "test")
    for deb in (work / "debs").glob("*.deb"):
        deb.unlink()
    return target / "test", debian_origin(deb_version, version)


# -- running -------------------------------------------------------------------------------

class Wasibox(Runner):
    """Each job in a fresh ``Sandbox`` run of the wasm backend."""

    name = "wasibox"

    def __init__(self, lib_test: Path, timeout_s: float) -> None:
        self.lib_test, self.timeout_s = lib_test, timeout_s

    def run(self, jobs: list[Job]) -> list[Outcome]:
        return [self._one(job) for job in jobs]

    def _one(self, job: Job) -> Outcome:
        # What CPython's tests assume of a process: test_tempfile holds 100 files open at
        # once (and, past the default cap of 64, every later test failed with EMFILE).
        limits = wasibox.Limits(timeout_s=job.timeout_s or self.timeout_s, fuel=10**13,
                                memory_bytes=1 << 30, output_bytes=16 * 2**20,
                                open_files=1024)
        mounts = [wasibox.Mount(self.lib_test, f"{GUEST_ROOT}/test"),
                  wasibox.Mount.scratch("/tmp")]
        started = time.monotonic()
        with wasibox.Sandbox(limits, backend="wasm", mounts=mounts) as sandbox:
            result = sandbox.run(job.code())
        outcome = parse_report(result.stdout) if result.ok else None
        if outcome is None:
            crashed = timed_out = False
            if result.limit_exceeded is not None:
                note = f"{result.limit_exceeded.value} limit"
                crashed = result.limit_exceeded is wasibox.Limit.MEMORY
                timed_out = result.limit_exceeded in (wasibox.Limit.TIMEOUT, wasibox.Limit.FUEL)
            elif result.error is not None:
                note = f"{result.error.type}: {result.error.message}".splitlines()[0]
                crashed = result.error.type in ("Trap", "RecursionError", "MemoryError")
            else:
                note = f"exit status {result.exit_code}"
            outcome = Outcome(note=note[:100], crashed=crashed, timed_out=timed_out)
        outcome.seconds = time.monotonic() - started
        return outcome


class Eryx(Runner):
    """Jobs in eryx, through one child process of the eryx venv's Python per batch."""

    name = "eryx"

    def __init__(self, python: Path, lib_test: Path, timeout_s: float) -> None:
        self.python, self.lib_test, self.timeout_s = python, lib_test, timeout_s

    def run(self, jobs: list[Job]) -> list[Outcome]:
        request = json.dumps({"lib_test": str(self.lib_test), "jobs": [
            [str(index), job.code(), job.timeout_s or self.timeout_s]
            for index, job in enumerate(jobs)]})
        started = time.monotonic()
        child = subprocess.run([str(self.python), "-c", ERYX_CHILD], input=request,
                               capture_output=True, text=True)
        seconds = (time.monotonic() - started) / max(len(jobs), 1)
        outcomes = [Outcome(note=f"eryx's process ended: {child.stderr.strip()[-80:]}")
                    for _ in jobs]
        for line in child.stdout.splitlines():
            reply = json.loads(line)
            parsed = parse_report(reply.get("stdout", ""))
            error = str(reply.get("error", "no report"))
            timed_out = bool(reply.get("timeout"))
            outcomes[int(reply["key"])] = parsed or Outcome(
                note=error[:100], crashed=not timed_out, timed_out=timed_out)
        for outcome in outcomes:
            outcome.seconds = seconds
        return outcomes


@dataclasses.dataclass
class Row:
    module: str
    wasibox: Outcome
    eryx: Outcome | None = None
    #: Tests failing in wasibox that eryx passes, and wasibox too when run on their own
    #: (``order_dependent``: they fail only after the module's other tests); the rest are
    #: ``wasibox_only``: failures wasibox adds.
    wasibox_only: dict[str, str] = dataclasses.field(default_factory=dict)
    order_dependent: list[str] = dataclasses.field(default_factory=list)
    #: Tests failing in wasibox that eryx skips: neither a failure eryx shares nor a test
    #: it passes (eryx cannot make symbolic links, say), so they are listed on their own.
    eryx_skips: dict[str, str] = dataclasses.field(default_factory=dict)


def compare(row: Row, ours: Wasibox, eryx: Eryx) -> None:
    """Fill ``row.wasibox_only``: failures in wasibox that eryx does not share."""
    bad = row.wasibox.bad
    if not bad or row.eryx is None:
        return
    if row.eryx.completed:
        skipped = row.eryx.skipped_ids
        candidates = sorted(set(bad) - set(row.eryx.bad))
    else:  # eryx could not run the module: ask it about wasibox's failures alone
        (rerun,) = eryx.run([Job(row.module, only=test_ids(bad))])
        skipped = rerun.skipped_ids
        candidates = (sorted(name for name in set(bad) - set(rerun.bad)
                             if test_ids([name])[0] not in rerun.missing)
                      if rerun.completed else [])
    row.eryx_skips = {name: bad[name] for name in candidates
                      if test_ids([name])[0] in skipped}
    candidates = [name for name in candidates if name not in row.eryx_skips]
    if not candidates:
        return
    # Each test in a run of its own: run together, one that leaves the scratch directory
    # behind (test_shutil's test_rmtree_above_recursion_limit, when the mounts' depth cap
    # was 32 levels) failed the next one too, which alone passes.
    tests = test_ids(candidates)
    still: set[str] = set()
    outcomes = ours.run([Job(row.module, only=(test,)) for test in tests])
    for test, alone in zip(tests, outcomes, strict=True):
        failing = {name for name in candidates if name.partition(" ")[0] == test}
        still |= set(alone.bad) & failing if alone.completed else failing
    row.wasibox_only = {name: bad[name] for name in candidates if name in still}
    row.order_dependent = [name for name in candidates if name not in still]


def test_ids(names: Iterable[str]) -> tuple[str, ...]:
    """The tests' ids of failure names: a subtest's name is its test's id, a space and its
    parameters."""
    return tuple(sorted({name.partition(" ")[0] for name in names}))


def cells(outcome: Outcome | None) -> str:
    if outcome is None:
        return ""
    if not outcome.completed or outcome.module_skipped:
        return f"{'-':>6} {'-':>5} {'-':>5} {'-':>5}"
    return (f"{outcome.run:>6} {len(outcome.failed):>5} {len(outcome.errored):>5} "
            f"{outcome.skipped:>5}")


def note(outcome: Outcome | None) -> str:
    if outcome is None:
        return ""
    if outcome.module_skipped:
        return f"skipped: {outcome.module_skipped}"
    return outcome.note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib-test", help="a Lib/test directory to use instead of the cache")
    parser.add_argument("--no-fetch", action="store_true",
                        help="never download Debian's test suite; print how to provide one")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per module")
    parser.add_argument("--eryx", action="store_true",
                        help="also run every module in eryx and compare failing tests")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run only these tests, test classes or doctests of each module "
                             "(ids, or names within the module: TestKDE, TestKDE.test_kde)")
    parser.add_argument("--durations", type=int, default=0, metavar="N",
                        help="print each module's N slowest tests, timed by the guest's "
                             "clock (wasibox's is virtual: 1 ns per unit of fuel)")
    parser.add_argument("--json", type=Path, help="also write every row, with test ids, here")
    args = parser.parse_args()

    version = wasibox.run("import sys; print(sys.version.split()[0])").stdout.strip()
    found = find_lib_test(args.lib_test, version)
    if found is None and not args.no_fetch:
        fetched = fetch_lib_test(version)
        if isinstance(fetched, str):
            print(f"Could not fetch a Lib/test tree: {fetched}.", file=sys.stderr)
        else:
            found = fetched
    if found is None:
        print(f"No Lib/test tree of CPython {version} was found. The guest does not carry "
              f"one (componentize-py leaves test/ out of its standard library). Download the "
              f"CPython {version} source release (Python-{version}.tgz from python.org), "
              f"unpack it, and run:\n\n    python bench/conformance.py --lib-test "
              f"Python-{version}/Lib/test\n\n(or set {LIB_TEST_ENV}, or unpack it so that "
              f"{cache_dir() / f'cpython-{version}' / 'Lib' / 'test'} exists).",
              file=sys.stderr)
        return 2
    lib_test, origin = found
    eryx: Eryx | None = None
    if args.eryx:
        python, how = ensure_eryx_venv(eryx_venv())
        print(f"eryx: {how}")
        if python is not None:
            eryx = Eryx(python, lib_test, args.timeout)
            probe = subprocess.run([str(python), "-c", ERYX_VERSION], capture_output=True,
                                   text=True)
            print(f"eryx {probe.stdout.strip() or probe.stderr.strip()[-200:]}")
    print(f"CPython {version} in the wasm guest; Lib/test: {origin}\n  ({lib_test})\n")
    header = f"{'module':<20} {'run':>6} {'fail':>5} {'error':>5} {'skip':>5} {'s':>6}"
    if eryx is not None:
        header += f" | eryx {'run':>6} {'fail':>5} {'error':>5} {'skip':>5} | only"
    print(header + "  note")
    ours = Wasibox(lib_test, args.timeout)
    rows: list[Row] = []
    for module in args.modules:
        only = None if args.tests is None else tuple(
            name if name.startswith("test.") else f"test.{module}.{name}"
            for name in args.tests)
        job = Job(module, only=only, slowest=args.durations)
        row = Row(module, ours.module(job))
        if eryx is not None:
            row.eryx = eryx.module(job)
            compare(row, ours, eryx)
        rows.append(row)
        line = f"{module:<20} {cells(row.wasibox)} {row.wasibox.seconds:>6.1f}"
        if eryx is not None:
            line += f" |      {cells(row.eryx)} | {len(row.wasibox_only):>4}"
        notes = [f"{runner}: {text}" for runner, text in
                 (("wasibox", note(row.wasibox)), ("eryx", note(row.eryx))) if text]
        print(line + "  " + "; ".join(notes), flush=True)
        for runner, outcome in (("wasibox", row.wasibox), ("eryx", row.eryx)):
            if outcome is None:
                continue
            for name, seconds in outcome.slowest:
                print(f"    {runner:<8} {seconds:>8.1f} s  {name}", flush=True)
            if outcome.missing:
                print(f"    {runner:<8} no such tests: {', '.join(outcome.missing)}")
    report(rows, eryx is not None)
    if args.json:
        args.json.write_text(json.dumps(
            {"guest_version": version, "lib_test": origin,
             "rows": [dataclasses.asdict(row) for row in rows]}, indent=1, default=sorted),
            encoding="utf-8")
    return 0


def report(rows: list[Row], with_eryx: bool) -> None:
    done = [row.wasibox for row in rows
            if row.wasibox.completed and not row.wasibox.module_skipped]
    run = sum(outcome.run for outcome in done)
    passed = sum(outcome.passed for outcome in done)
    failed = sum(len(outcome.failed) for outcome in done)
    errored = sum(len(outcome.errored) for outcome in done)
    skipped = sum(outcome.skipped for outcome in done)
    whole = [row.module for row in rows if row.wasibox.module_skipped]
    broken = [row.module for row in rows if not row.wasibox.completed]
    print(f"\n{passed} of {run} tests passed in the guest ({failed} failures, {errored} "
          f"errors, {skipped} skipped) over {len(done)} modules; skipped whole: "
          f"{', '.join(whole) or 'none'}; no report: {', '.join(broken) or 'none'}")
    reasons: dict[str, int] = {}
    for outcome in done:
        for reason, number in outcome.skip_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + number
    print("most common skip reasons:")
    for reason, number in sorted(reasons.items(), key=lambda item: -item[1])[:15]:
        print(f"  {number:>5}  {reason}")
    print("failing tests (wasibox only: eryx passes it; order: fails only after the "
          "module's other tests; eryx skips: eryx does not run it):")
    for row in rows:
        for name, summary in row.wasibox.bad.items():
            tag = ("wasibox only" if name in row.wasibox_only else
                   "order" if name in row.order_dependent else
                   "eryx skips" if name in row.eryx_skips else "")
            print(f"  {tag:<12} {name}: {summary}"[:220])
    if with_eryx:
        only = sum(len(row.wasibox_only) for row in rows)
        skips = sum(len(row.eryx_skips) for row in rows)
        print(f"\n{only} failing tests are wasibox's alone (eryx passes them, and they fail "
              f"in wasibox run on their own too); {skips} more fail in wasibox where eryx "
              f"skips them")


if __name__ == "__main__":
    sys.exit(main())
