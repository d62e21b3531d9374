"""Conformance: CPython's own regression tests, run in the wasm guest, one module per run.

What it does (everything is printed; nothing is asserted, and it is not part of the tests):
for each test module, a fresh ``Sandbox`` run mounts the ``Lib/test`` tree of the guest's
exact CPython version read-only at ``/cpython/test``, imports ``test.<module>`` from it, runs
it with ``unittest`` and reports tests run, failures, errors and skipped. A module that
cannot even be imported, or whose run ends in a limit or a trap, gets a row saying so. The
total line is the figure the README tracks.

The test tree is not part of the guest (componentize-py's bundled standard library leaves
``test/`` out), and neither PyPI nor Debian ships CPython 3.14.0's ``Lib/test`` on its own.
Give it one of:

    python bench/conformance.py --lib-test Python-3.14.0/Lib/test   # from the source release
    WASIBOX_CPYTHON_LIB_TEST=.../Lib/test python bench/conformance.py

or put the tree at ``<wasibox cache>/cpython-<version>/Lib/test``, where the script looks by
default. ``--modules test_json test_csv`` runs only those; ``--timeout`` is per module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import wasibox
from wasibox._guest import cache_dir

#: Modules that exercise what ordinary code uses; the platform-limited ones (threads,
#: subprocess, sockets, signals) are here too, so their rows say what the guest lacks.
DEFAULT_MODULES = (
    "test_abc", "test_argparse", "test_array", "test_base64", "test_binascii", "test_bisect",
    "test_bool", "test_bytes", "test_calendar", "test_collections", "test_contextlib",
    "test_copy", "test_csv", "test_dataclasses", "test_datetime", "test_decimal",
    "test_dict", "test_difflib", "test_enum", "test_float", "test_fractions",
    "test_functools", "test_glob", "test_hashlib", "test_heapq", "test_html", "test_int",
    "test_itertools", "test_json", "test_list", "test_math", "test_operator",
    "test_pathlib", "test_pickle", "test_random", "test_re", "test_set", "test_shutil",
    "test_statistics", "test_string", "test_struct", "test_tempfile", "test_textwrap",
    "test_tomllib", "test_typing", "test_unicodedata", "test_uuid", "test_zlib",
)
LIB_TEST_ENV = "WASIBOX_CPYTHON_LIB_TEST"
GUEST_ROOT = "/cpython"

#: The guest side: a finder for the mounted ``test`` package (the guest's importer has no
#: path-based finder: its files exist only through the host), then one unittest run.
GUEST_PROGRAM = textwrap.dedent("""
    import importlib.abc, importlib.util, io, json, os, sys, unittest

    ROOT = %(root)r

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
    os.chdir("/tmp")
    stream = io.StringIO()
    suite = unittest.defaultTestLoader.loadTestsFromName("test." + %(module)r)
    result = unittest.TextTestRunner(stream=stream, verbosity=0).run(suite)
    print(json.dumps({"run": result.testsRun, "failures": len(result.failures),
                      "errors": len(result.errors), "skipped": len(result.skipped)}))
""")


def find_lib_test(given: str | None, version: str) -> Path | None:
    """The Lib/test directory to mount: the argument, the environment, or the cache."""
    for candidate in (given, os.environ.get(LIB_TEST_ENV),
                      str(cache_dir() / f"cpython-{version}" / "Lib" / "test")):
        if candidate and (Path(candidate) / "__init__.py").is_file():
            return Path(candidate).resolve()
    return None


def run_module(lib_test: Path, module: str, timeout_s: float) -> dict[str, object]:
    limits = wasibox.Limits(timeout_s=timeout_s, fuel=10**13, memory_bytes=1 << 30,
                            output_bytes=16 * 2**20)
    mounts = [wasibox.Mount(lib_test, f"{GUEST_ROOT}/test"), wasibox.Mount.scratch("/tmp")]
    started = time.monotonic()
    with wasibox.Sandbox(limits, backend="wasm", mounts=mounts) as sandbox:
        result = sandbox.run(GUEST_PROGRAM % {"root": GUEST_ROOT, "module": module})
    row: dict[str, object] = {"module": module, "seconds": time.monotonic() - started}
    last = result.stdout.strip().rpartition("\n")[2]
    if result.ok and last.startswith("{"):
        row.update(json.loads(last))
    elif result.limit_exceeded is not None:
        row["note"] = f"{result.limit_exceeded.value} limit"
    elif result.error is not None:
        row["note"] = f"{result.error.type}: {result.error.message}"[:70]
    else:
        row["note"] = f"exit status {result.exit_code}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib-test", help="the Lib/test directory of the guest's CPython")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per module")
    args = parser.parse_args()

    version = wasibox.run("import sys; print(sys.version.split()[0])").stdout.strip()
    lib_test = find_lib_test(args.lib_test, version)
    if lib_test is None:
        print(f"No Lib/test tree of CPython {version} was found. The guest does not carry "
              f"one (componentize-py leaves test/ out of its standard library). Download the "
              f"CPython {version} source release (Python-{version}.tgz from python.org), "
              f"unpack it, and run:\n\n    python bench/conformance.py --lib-test "
              f"Python-{version}/Lib/test\n\n(or set {LIB_TEST_ENV}, or unpack it so that "
              f"{cache_dir() / f'cpython-{version}' / 'Lib' / 'test'} exists).",
              file=sys.stderr)
        return 2
    print(f"CPython {version} in the wasm guest; Lib/test from {lib_test}\n")
    print(f"{'module':<24} {'run':>6} {'fail':>6} {'error':>6} {'skip':>6} {'s':>7}  note")
    totals = {"run": 0, "failures": 0, "errors": 0, "skipped": 0}
    for module in args.modules:
        row = run_module(lib_test, module, args.timeout)
        for key in totals:
            value = row.get(key, 0)
            totals[key] += value if isinstance(value, int) else 0
        cells = [str(row.get(key, "-")) for key in totals]
        print(f"{module:<24} {cells[0]:>6} {cells[1]:>6} {cells[2]:>6} {cells[3]:>6} "
              f"{row['seconds']:>7.1f}  {row.get('note', '')}", flush=True)
    passed = totals["run"] - totals["failures"] - totals["errors"] - totals["skipped"]
    print(f"\n{passed} of {totals['run']} tests passed in the guest "
          f"({totals['failures']} failures, {totals['errors']} errors, "
          f"{totals['skipped']} skipped) over {len(args.modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
