"""CPython conformance: what ordinary code sees in the guest matches a native CPython 3.14.

Each test holds one of the differences a run of CPython's own test suite found (issue 19),
on the real guest under Wasmtime.
"""

from __future__ import annotations

import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import Limit, Limits
from wasibox.backends.wasm.run import VIRTUAL_EPOCH_S
from wasibox.backends.wasm.traps import TRAP_KINDS, trap_kind
from wasibox.capabilities.files.mount import STAGING_DIR

pytestmark = pytest.mark.guest


def test_argv_is_a_single_empty_string_so_argparse_works(sandbox: wasibox.Sandbox) -> None:
    result = sandbox.run(textwrap.dedent("""
        import argparse, sys
        parser = argparse.ArgumentParser()
        parser.add_argument("--n", type=int, default=3)
        print(sys.argv, parser.parse_args([]).n, parser.prog)
    """))
    assert result.ok, result.error
    assert result.stdout == "[''] 3 \n"


def test_text_and_bytes_written_to_stdout_come_out_in_native_order(
        run_path_sandbox: wasibox.Sandbox) -> None:
    # Text waits in sys.stdout's text layer, and bytes in its buffer, until a flush (or
    # 8 KiB): they come out in the order a native CPython writing to a pipe gives them.
    code = textwrap.dedent("""
        import sys
        print(type(sys.stdout.buffer).__name__)
        print('text first')
        sys.stdout.buffer.write(b'bytes\\n')
        print('x' * 10000)
        sys.stdout.write('held ')
        sys.stdout.buffer.write(b'passes it\\n')
        sys.stdout.flush()
        sys.stdout.buffer.write(b'last')
        sys.stderr.write('err no newline')
    """)
    # -I: PYTHONUNBUFFERED, were it set here, would make the native stdout write-through.
    native = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True,
                            check=True)
    result = run_path_sandbox.run(code)
    assert result.ok, result.error
    assert (result.stdout, result.stderr) == (native.stdout.decode(), native.stderr.decode())


def test_sys_path_starts_with_the_current_directory_as_python_c_does(tmp_path: Path) -> None:
    # test_grammar reads sys.path[0]. The current directory is importable, through the
    # mounts; a module there still cannot shadow the stdlib.
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "colorsys.py").write_text("raise SystemExit('shadowed the stdlib')\n")
    with wasibox.Sandbox(workspace=tmp_path) as sandbox:
        result = sandbox.run(textwrap.dedent("""
            import os, sys
            print(sys.path)
            try:
                import helper
            except ImportError:
                print("not at /")
            os.chdir("/workspace")
            import helper, colorsys
            print(helper.VALUE, helper.__file__, colorsys.__file__)
        """))
    assert result.ok, result.error
    assert result.stdout.splitlines() == [
        "['']", "not at /", "7 /workspace/helper.py <stdlib>/colorsys.py"]


def test_lazily_imported_stdlib_modules_have_a_file(sandbox: wasibox.Sandbox) -> None:
    # _strptime needs __file__ for the leap-day warning; native CPython 3.14 then raises
    # this ValueError (no year means 1900).
    result = sandbox.run(textwrap.dedent("""
        import datetime, _strptime, colorsys, email.mime.text
        print(_strptime.__file__, colorsys.__file__, email.mime.text.__file__)
        try:
            datetime.datetime.strptime("02-29", "%m-%d")
        except ValueError as exc:
            print("ValueError", exc)
        print(datetime.datetime.strptime("2024-02-29", "%Y-%m-%d").day)
    """))
    assert result.ok, result.error
    lines = result.stdout.splitlines()
    assert lines[0] == "<stdlib>/_strptime.py <stdlib>/colorsys.py <stdlib>/email/mime/text.py"
    assert lines[1].startswith("ValueError day 29 must be in range")
    assert lines[2] == "29"


def test_tracebacks_and_inspect_show_stdlib_source(sandbox: wasibox.Sandbox) -> None:
    # test_contextlib compares the lines of a traceback through contextlib (preloaded into
    # the snapshot); colorsys is imported lazily, from the packed stdlib.
    result = sandbox.run(textwrap.dedent("""
        import colorsys, contextlib, inspect, traceback
        try:
            with contextlib.ExitStack() as stack:
                stack.callback(lambda: 1 / 0)
        except ZeroDivisionError as exc:
            print([frame.line for frame in traceback.extract_tb(exc.__traceback__)])
        print(inspect.getsource(colorsys.rgb_to_yiq).splitlines()[0])
    """))
    assert result.ok, result.error
    assert result.stdout.splitlines() == [
        "['with contextlib.ExitStack() as stack:', 'raise exc', 'if cb(*exc_details):', "
        "'callback(*args, **kwds)', 'stack.callback(lambda: 1 / 0)']",
        "def rgb_to_yiq(r, g, b):"]


def test_file_errors_carry_no_internal_context_and_unittest_reports_them(
        sandbox: wasibox.Sandbox) -> None:
    result = sandbox.run(textwrap.dedent("""
        import errno, io, unittest
        try:
            open("/nowhere/file.txt")
        except FileNotFoundError as exc:
            print(exc.__context__, exc.errno == errno.ENOENT)

        class T(unittest.TestCase):
            def test_missing(self):
                open("/nowhere/file.txt")
            def test_fine(self):
                pass

        stream = io.StringIO()
        outcome = unittest.TextTestRunner(stream=stream).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(T))
        print(outcome.testsRun, len(outcome.errors), "FileNotFoundError" in stream.getvalue())
    """))
    assert result.ok, result.error
    assert result.stdout == "None True\n2 1 True\n"


@pytest.mark.parametrize("code", ["open('/nowhere')", "import os\nos.urandom(2**40)",
                                  "import os\ntry:\n    os.stat('/x')\nexcept OSError:\n"
                                  "    raise ValueError('chained')"])
def test_tracebacks_show_no_frames_for_what_is_c_natively(sandbox: wasibox.Sandbox,
                                                          code: str) -> None:
    result = sandbox.run(code)
    assert result.error is not None
    frames = re.findall(r'File "([^"]+)"', result.error.traceback)
    assert frames and set(frames) == {"<sandbox>"}, result.error.traceback


def test_import_time_deprecation_warnings_name_the_importing_line(
        sandbox: wasibox.Sandbox) -> None:
    result = sandbox.run("import warnings\nwarnings.simplefilter('always')\nimport sre_compile\n")
    assert result.ok, result.error
    assert result.stderr.startswith("<sandbox>:3: DeprecationWarning: module 'sre_compile'")
    assert "wasibox_guest" not in result.stderr


def test_a_warning_reaching_past_the_program_is_placed_where_cpython_places_it(
        sandbox: wasibox.Sandbox) -> None:
    code = ("import warnings\nwarnings.warn('top', UserWarning, stacklevel=2)\n"
            "def f():\n    warnings.warn('inner', UserWarning, stacklevel=3)\nf()\n")
    result = sandbox.run(code)
    assert result.ok, result.error
    lines = result.stderr.splitlines()
    # No frame left to blame: CPython names `sys` (3.11: "sys:1", newer: "<sys>:0").
    assert len(lines) == 2 and "wasibox" not in result.stderr
    assert re.fullmatch(r"<?sys>?:\d+: UserWarning: top", lines[0])
    assert re.fullmatch(r"<?sys>?:\d+: UserWarning: inner", lines[1])


def test_chmod_and_mkdir_modes_are_shown_and_published(tmp_path: Path) -> None:
    with wasibox.Sandbox(workspace=tmp_path) as sandbox:
        result = sandbox.run(textwrap.dedent("""
            import errno, os, stat
            def mode(path):
                return oct(stat.S_IMODE(os.stat(path).st_mode))
            open("/workspace/ro.txt", "w").write("x")
            os.chmod("/workspace/ro.txt", 0o444)
            os.mkdir("/workspace/private", 0o750)
            os.mkdir("/workspace/locked", 0o500)
            fd = os.open("/workspace/wo.txt", os.O_CREAT | os.O_WRONLY, 0o200)
            os.write(fd, b"y")
            os.close(fd)
            print(mode("/workspace/ro.txt"), mode("/workspace/private"),
                  mode("/workspace/locked"), mode("/workspace/wo.txt"))
            try:
                os.chmod("/workspace/ro.txt", 0o4755)
            except PermissionError as exc:
                print("set-id refused", exc.errno == errno.EPERM, mode("/workspace/ro.txt"))
        """))
    assert result.ok, result.error
    assert result.stdout.splitlines() == ["0o444 0o750 0o500 0o200",
                                          "set-id refused True 0o444"]
    published = {name: oct(stat.S_IMODE((tmp_path / name).stat().st_mode))
                 for name in ("ro.txt", "private", "locked", "wo.txt")}
    assert published == {"ro.txt": "0o444", "private": "0o750", "locked": "0o500",
                         "wo.txt": "0o200"}
    assert (tmp_path / "wo.txt").read_bytes() == b"y"


def test_tempfile_cleans_up_on_a_mount_as_cpython_does(tmp_path: Path) -> None:
    # tempfile is imported before the file layer is, and bound os.unlink as a default
    # argument: NamedTemporaryFile then never removed its file (CPython's test_tempfile).
    with wasibox.Sandbox(workspace=tmp_path) as sandbox:
        result = sandbox.run(textwrap.dedent("""
            import io, os, tempfile
            with tempfile.NamedTemporaryFile(dir="/workspace") as named:
                named.write(b"x")
                print(os.path.exists(named.name))
            print(os.path.exists(named.name))
            with tempfile.TemporaryDirectory(dir="/workspace") as folder:
                with tempfile.NamedTemporaryFile(dir=folder, delete=False) as kept:
                    pass
                os.unlink(kept.name)
            print(os.path.exists(folder), sorted(os.listdir("/workspace")))
            with open("/workspace/m", "w+b") as handle, io.FileIO("/workspace/m", "w+") as raw:
                print(handle.mode, handle.raw.mode, raw.mode)
            class Kept:  # built-ins kept as class attributes do not become methods
                _unlink, _open, _stat = os.unlink, open, os.stat
            Kept()._open("/workspace/m", "rb").close()
            print(Kept()._stat("/workspace/m").st_size, os.stat in os.supports_fd)
            Kept()._unlink("/workspace/m")

            class Made:  # as test_tempfile's mktemped: freed at once, no collection needed
                def __init__(self):
                    self.name = tempfile.mktemp(dir="/workspace")  # its lstat fails: ENOENT
                    os.close(os.open(self.name, os.O_CREAT | os.O_RDWR, 0o600))
                def __del__(self):
                    os.unlink(self.name)
            Made()
            import gc
            print(os.listdir("/workspace"), gc.get_threshold())
        """))
    assert result.ok, result.error
    assert result.stdout.splitlines() == ["True", "False", "False []", "rb+ rb+ rb+",
                                          "0 True", "[] (2000, 10, 0)"]
    assert [path.name for path in tmp_path.iterdir()] in ([], [STAGING_DIR])


@pytest.mark.parametrize("code, error", [
    ("import os\nos.urandom(2**40)", "OverflowError"),
    ("import os\nos.urandom(2**31 - 1)", "MemoryError"),
    ("import random\nrandom.SystemRandom().getrandbits(1 << 1000)", "OverflowError"),
    ("import random\nrandom.SystemRandom().getrandbits(1 << 40)", "OverflowError"),
])
def test_huge_entropy_requests_fail_fast(code: str, error: str) -> None:
    with wasibox.Sandbox(Limits(timeout_s=20, memory_bytes=256 * 2**20)) as sandbox:
        started = time.monotonic()
        result = sandbox.run(code)
        elapsed = time.monotonic() - started
    assert result.error is not None and result.error.type == error
    # Not a limit: the guest gets CPython's exception, long before the deadline.
    assert result.limit_exceeded in (None, Limit.MEMORY) and elapsed < 10
    small = sandbox_run("import os\nprint(len(os.urandom(3 * 2**20 + 5)))")
    assert small.stdout == f"{3 * 2**20 + 5}\n"


def sandbox_run(code: str) -> wasibox.RunResult:
    with wasibox.Sandbox() as sandbox:
        return sandbox.run(code)


DEEP = "l = []\nfor i in range(200000):\n    l = [l]\n"
#: Deeper than the guest's C stack held before its limit was fitted (each of these trapped
#: at 2,000 to 3,400 levels), shallow enough to be freed afterwards (about 17,000 levels).
NESTED = 10_000


@pytest.mark.parametrize("operation", [
    "repr(l)", "str(t)", "import pickle\npickle.dumps(l)", "import json\njson.dumps(l)",
    "import json\njson.loads('[' * 100_000)", "l == m"])
def test_c_stack_exhaustion_is_a_catchable_recursion_error(
        sandbox: wasibox.Sandbox, operation: str) -> None:
    result = sandbox.run(textwrap.dedent(f"""
        import sys
        sys.setrecursionlimit(100_000)
        l, m, t = [], [], ()
        for _ in range({NESTED}):
            l, m, t = [l], [m], (t,)
        try:
    """) + textwrap.indent(operation, "    ") + textwrap.dedent("""
        except RecursionError as exc:
            print("caught:", exc)
        print("the run goes on")
    """))
    assert result.ok, result.error
    caught, goes_on = result.stdout.splitlines()
    assert re.fullmatch(r"caught: Stack overflow \(used 12\d kB\).*", caught)
    assert goes_on == "the run goes on"


def test_runaway_recursion_under_a_raised_limit_is_a_catchable_recursion_error(
        sandbox: wasibox.Sandbox) -> None:
    # Python calls take no C stack, but freeing the caught error's 15,000 tracebacks, one
    # inside the other, does: that trapped past ~4,500.
    result = sandbox.run(textwrap.dedent("""
        import sys
        sys.setrecursionlimit(15_000)
        def f(n):
            return f(n + 1)
        try:
            f(0)
        except RecursionError as exc:
            print("caught:", exc)
        print("the run goes on")
    """))
    assert result.ok, result.error
    assert result.stdout == ("caught: maximum recursion depth exceeded\n"
                             "the run goes on\n")


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(["[x]", "(x,)", "{'k': x}", "Node(x)"]),
       operation=st.sampled_from(["repr", "str", "pickle.dumps", "json.dumps", "copy.deepcopy",
                                  "(lambda v: v == keep(copy.deepcopy(v)))"]),
       depth=st.integers(1, 12_000))
def test_deep_nesting_raises_or_works_and_never_traps(
        sandbox: wasibox.Sandbox, shape: str, operation: str, depth: int) -> None:
    # Node's __repr__ and __eq__ are Python, so each level also re-enters the interpreter.
    # What is built and made is kept (on sys) to the end of the instance, the comparison's
    # copy too: freeing it is the unguarded recursion of the test below, whose depth limit
    # depends on the type (a 6,000-deep copy freed as a temporary traps).
    result = sandbox.run(textwrap.dedent(f"""
        import copy, json, pickle, sys
        sys.setrecursionlimit(100_000)
        class Node:
            def __init__(self, child):
                self.child = child
            def __repr__(self):
                return f"Node({{self.child!r}})"
            def __eq__(self, other):
                return self.child == other
        x = None
        for _ in range({depth}):
            x = {shape}
        sys.kept = [x]
        def keep(made):
            sys.kept.append(made)
            return made
        try:
            sys.kept.append({operation}(x))
            print("done")
        except RecursionError:
            print("RecursionError")
        except (TypeError, pickle.PicklingError):
            print("cannot encode")  # a Node: json has no encoding, pickle cannot import it
    """))
    assert result.ok, result.error
    assert result.stdout in ("done\n", "RecursionError\n", "cannot encode\n")


def test_what_cpython_does_not_guard_is_a_typed_trap_and_the_sandbox_goes_on(
        sandbox: wasibox.Sandbox) -> None:
    # Freeing a 200,000-deep list recurses in C with no check (CPython 3.14 defers it by
    # the shadow stack, which freeing hardly uses): Wasmtime's stack limit ends the run.
    result = sandbox.run(DEEP + "del l\n")
    assert result.limit_exceeded is None
    assert result.error is not None and result.error.type == "RecursionError"
    assert result.error.message.startswith("stack overflow")
    assert sandbox.run("print(1)").stdout == "1\n"


def test_trap_reports_its_kind(sandbox: wasibox.Sandbox) -> None:
    result = sandbox.run("import os\nos.abort()")
    assert result.error is not None and result.error.type == "Trap"
    assert result.error.message == "the guest trapped: unreachable in libc.so!abort"


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(noise=st.sampled_from(["MemoryError", "out of memory", "call stack exhausted",
                              "interrupt", "all fuel consumed by WebAssembly"])
       | st.text(max_size=40))
def test_guest_output_never_changes_how_a_trap_is_classified(
        sandbox: wasibox.Sandbox, noise: str) -> None:
    result = sandbox.run(f"import sys\nprint({noise!r}, file=sys.stderr)\nprint({noise!r})\n"
                         + DEEP + "del l")
    assert result.limit_exceeded is None
    assert result.error is not None and result.error.type == "RecursionError"


ENGINE_MESSAGE = ("error while executing at wasm backtrace:\n"
                  "    0: libpython3.14.so!unicodekeys_lookup_unicode\n"
                  "    1: 0x1d4bc93 - libpython3.14.so!_Py_dict_lookup\n"
                  "\nCaused by:\n    wasm trap: {}\n")


@pytest.mark.parametrize("description, kind", sorted(TRAP_KINDS.items()))
def test_trap_kind_reads_wasmtimes_description(description: str, kind: str) -> None:
    assert trap_kind(ENGINE_MESSAGE.format(description)) == (
        kind, ("libpython3.14.so!unicodekeys_lookup_unicode", "libpython3.14.so!_Py_dict_lookup"))


@given(st.text())
def test_trap_kind_of_any_text_is_a_known_kind_or_none(message: str) -> None:
    kind, frames = trap_kind(message)
    assert kind is None or kind in TRAP_KINDS.values()
    assert all(isinstance(frame, str) for frame in frames)


#: The os functions whose path argument the file layer converts, each with the arguments
#: after it; the original (the guest CPython's own, which sees no files) is the oracle.
PATH_CALLS = {
    "stat": "()", "lstat": "()", "access": "(os.F_OK,)", "open": "(os.O_RDONLY,)",
    "listdir": "()", "scandir": "()", "mkdir": "()", "unlink": "()", "remove": "()",
    "rmdir": "()", "chmod": "(0o644,)", "utime": "()", "rename": "('x',)",
    "replace": "('x',)", "readlink": "()", "truncate": "(0,)", "chdir": "()",
}
#: Those whose original takes a descriptor: an integer is no bad argument there.
TAKES_FD = {"stat", "truncate", "utime"}
#: Path arguments no os function takes, as source for the guest.
BAD_PATHS = st.one_of(
    st.sampled_from(["1.5", "object()", "[]", "1j", "bytearray(b'x')", "memoryview(b'x')",
                     "FakePath(3)", "FakePath(None)", "FakePath(1.5)",
                     "FakePath(bytearray(b'x'))", "FakePath(FakePath('x'))"]),
    st.tuples(st.text(st.characters(codec="utf-8", exclude_characters="\x00")),
              st.text(st.characters(codec="utf-8"))).map(lambda p: repr(p[0] + "\x00" + p[1])),
    st.binary().map(lambda data: repr(data + b"\x00")),
    st.integers(-2**70, 2**70).map(repr),
).flatmap(lambda source: st.sampled_from([source, f"FakePath({source})"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=BAD_PATHS)
def test_path_arguments_are_checked_as_cpythons_path_t_converter(source: str) -> None:
    # CPython's test_os (PathTConverterTests, TestPEP519, TestScandir.test_bytes_like)
    # checks the exception type and message of each kind of bad path.
    integer = source.lstrip("-").isdigit()  # a descriptor, not a path, to open()
    calls = {name: extra for name, extra in PATH_CALLS.items()
             if not (name in TAKES_FD and integer)}
    result = sandbox_run(textwrap.dedent(f"""
        import io, os, sys
        layer = sys.modules["wasibox_files"]
        originals = layer._real
        class FakePath:
            def __init__(self, path):
                self.path = path
            def __fspath__(self):
                return self.path
        def outcome(function, extra):
            try:
                function(eval({source!r}), *eval(extra))
            except Exception as exc:
                return type(exc).__name__ + ": " + str(exc)
            return "no error"
        pairs = [(name, getattr(os, name), originals[name], extra)
                 for name, extra in {calls!r}.items()]
        if not {integer!r}:
            pairs += [("open()", open, layer._real_open, "()"),
                      ("FileIO", io.FileIO, layer._RealFileIO, "()")]
        for name, function, original, extra in pairs:
            ours, native = outcome(function, extra), outcome(original, extra)
            if name == "utime":  # not in os.supports_fd here: an integer is a bad path
                native = native.replace(", os.PathLike or integer", " or os.PathLike")
            print(name, ours == native, ours, "|", native)
    """))
    assert result.ok, result.error
    differ = [line for line in result.stdout.splitlines() if line.split()[1] != "True"]
    assert not differ, "\n".join(differ)
    assert len(result.stdout.splitlines()) == len(calls) + (0 if integer else 2)


def test_descriptor_calls_on_a_mount_behave_as_cpythons(tmp_path: Path) -> None:
    # CPython's test_os: os.readinto (new in 3.14), get_blocking/set_blocking, DirEntry's
    # refusal to pickle, scandir's ResourceWarning; and arguments the host interface cannot
    # carry (a float descriptor, a size past 32 bits), which ended the run in a trap.
    (tmp_path / "data").write_bytes(b"spam")
    with wasibox.Sandbox(workspace=tmp_path) as sandbox:
        result = sandbox.run(textwrap.dedent("""
            import copy, gc, os, pickle, warnings
            def outcome(call):
                try:
                    return repr(call())
                except Exception as exc:
                    return type(exc).__name__
            fd = os.open("/workspace/data", os.O_RDWR)
            buffer = bytearray(7)
            print(os.readinto(fd, buffer), bytes(buffer), os.readinto(fd, buffer),
                  os.readinto(fd, bytearray()))
            print([outcome(lambda: os.readinto(fd, bad)) for bad in ("x", b"", 14)],
                  outcome(lambda: os.readinto(float(fd), buffer)))
            os.lseek(fd, 0, 0)
            print(os.read(fd, 2**40), outcome(lambda: os.read(fd, "1")),
                  outcome(lambda: os.read(float(fd), 1)), outcome(lambda: os.lseek(fd, 0, 300)),
                  outcome(lambda: os.lseek(fd, 2**70, 0)),
                  outcome(lambda: os.ftruncate(fd, 2**64)),
                  outcome(lambda: os.pread(fd, 1, 2**64)))
            print(os.get_blocking(fd), end=" ")
            os.set_blocking(fd, False)
            print(os.get_blocking(fd), end=" ")
            os.set_blocking(fd, True)
            print(os.get_blocking(fd))
            os.close(fd)
            print(outcome(lambda: os.readinto(fd, buffer)), outcome(lambda: os.get_blocking(fd)))
            entry = next(iter(os.scandir("/workspace")))
            print(outcome(lambda: pickle.dumps(entry)), outcome(lambda: copy.copy(entry)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                iterator = os.scandir("/workspace")
                next(iterator)
                del iterator
                list(os.scandir("/workspace"))
                with os.scandir("/workspace") as iterator:
                    next(iterator)
                gc.collect()
            print([str(warning.category.__name__) for warning in caught])
        """))
    assert result.ok, result.error
    assert result.stdout.splitlines() == [
        "4 b'spam\\x00\\x00\\x00' 0 0",
        "['TypeError', 'TypeError', 'TypeError'] TypeError",
        "b'spam' TypeError TypeError OSError OverflowError OverflowError OverflowError",
        "True False True",
        "OSError OSError",
        "TypeError TypeError",
        "['ResourceWarning']",
    ]


def test_utime_now_is_the_runs_clock_and_bad_times_are_refused(tmp_path: Path) -> None:
    # os.utime(path) set the host's time: a virtual-clock run read the host's clock off
    # the file (and was no longer deterministic). test_os's UtimeTests.
    program = textwrap.dedent("""
        import os, time
        class BadInt:
            def __init__(self, answer):
                self.answer = answer
            def __divmod__(self, other):
                return self.answer
        def outcome(call):
            try:
                call()
            except Exception as exc:
                return type(exc).__name__
            return "ok"
        open("/workspace/f", "w").close()
        os.utime("/workspace/f")
        print(os.stat("/workspace/f").st_mtime_ns, time.time_ns())
        bad = [lambda: os.utime("/workspace/f", [5, 5]), lambda: os.utime("/workspace/f", (5,)),
               lambda: os.utime("/workspace/f", ns=[5, 5]),
               lambda: os.utime("/workspace/f", ns=(BadInt(42), 1)),
               lambda: os.utime("/workspace/f", ns=(BadInt((1, 2, 3)), 1)),
               lambda: os.utime("/workspace/f", ns=(2**70, 0)),
               lambda: os.utime("/workspace/f", (float("nan"), 0)),
               lambda: os.utime("/workspace/f", ("1", 0)),
               lambda: os.utime(3, (5, 5))]
        print(*[outcome(call) for call in bad])
        os.utime("/workspace/f", (1.75, 2.25))
        print(os.stat("/workspace/f").st_atime_ns, os.stat("/workspace/f").st_mtime_ns)
        os.utime("/workspace/f", ns=(BadInt((3, 4)), 5))
        print(os.stat("/workspace/f").st_atime_ns, os.stat("/workspace/f").st_mtime_ns)
    """)
    lines = []
    for run in ("first", "second", "real"):
        (tmp_path / run).mkdir()
    for run in ("first", "second"):
        with wasibox.Sandbox(workspace=tmp_path / run) as sandbox:
            result = sandbox.run(program)
        assert result.ok, result.error
        lines.append(result.stdout.splitlines())
    mtime, now = map(int, lines[0][0].split())
    # Deterministic, as a virtual-clock run is, up to the files' own metadata: each run's
    # file has its own inode number, whose digits the guest parses (a few units of fuel,
    # so of virtual nanoseconds, apart).
    assert all(abs(a - b) < 1000 for a, b in zip(map(int, lines[0][0].split()),
                                                  map(int, lines[1][0].split()), strict=True))
    assert lines[0][1:] == lines[1][1:]
    assert VIRTUAL_EPOCH_S * 10**9 < mtime <= now < mtime + 10**9
    assert lines[0][1:] == [
        "TypeError TypeError TypeError TypeError TypeError OverflowError ValueError "
        "TypeError TypeError",
        "1750000000 2250000000",
        "3000000004 5",  # divmod(BadInt, 10**9) is (3, 4): 3 s and 4 ns
    ]
    with wasibox.Sandbox(workspace=tmp_path / "real", clock="real") as sandbox:
        before = time.time_ns()
        result = sandbox.run(program)
    assert result.ok, result.error
    assert before <= int(result.stdout.split()[0]) <= time.time_ns()
