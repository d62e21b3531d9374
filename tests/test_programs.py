"""Real programs: the user's own modules and packages in a mount, stdin, argv and environment.

A multi-module project (a package with relative imports, a subpackage, a data file, a
namespace package) runs on the wasm guest and, where QEMU and the image exist, on the
microVM, with the same output. Tracebacks name the user's files and lines.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import wasibox

# vm_runtime: the session's VM runtime (it skips only where QEMU or the image is missing).
from tests.backends.microvm.test_backend import vm_runtime  # noqa: F401
from tests.conftest import PYTHON, child_env
from wasibox import Mount, UsageError

pytestmark = pytest.mark.guest

MAIN = textwrap.dedent("""\
    import importlib.resources
    import importlib.util
    import io
    import json
    import linecache
    import os
    import runpy
    import sys
    import tokenize

    import helpers
    from shop import checkout
    from shop.rates import table
    import plugins.extra.tax as tax

    report = {
        "total": checkout.total([3, 4]),
        "rates": table.RATES,
        "tax": tax.RATE,
        "data": importlib.resources.files("shop").joinpath("prices.csv").read_text(),
        "packaged": importlib.resources.files("shop.rates").joinpath("info.txt").read_bytes()
                    .decode(),
        "namespace": list(sys.modules["plugins"].__path__),
        "file": helpers.__file__,
        "spec": None,
        "runpy": runpy.run_path("/src/helpers.py")["double"](5),
        "open_code": io.open_code("/src/helpers.py").read().decode().splitlines()[0],
        "fileio": io.FileIO("/src/shop/prices.csv").read().decode(),
        "os_open": os.read(os.open("/src/helpers.py", os.O_RDONLY), 9).decode(),
        "tokenize": tokenize.open("/src/helpers.py").readline(),
        "linecache": linecache.getline("/src/shop/checkout.py", 4),
        "argv": sys.argv,
        "env": dict(os.environ),
        "stdin": sys.stdin.read(),
        "main_file": __file__,
    }
    spec = importlib.util.spec_from_file_location("loose", "/src/helpers.py")
    loose = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loose)
    report["spec"] = loose.double(21)
    print(json.dumps(report, sort_keys=True))
    if "--fail" in sys.argv:
        checkout.total([1, None])
""")

FAIL_LINE = MAIN.splitlines().index("    checkout.total([1, None])") + 1

PROJECT = {
    "main.py": MAIN,
    "helpers.py": "# helpers\ndef double(x):\n    return 2 * x\n",
    "shop/__init__.py": "from . import checkout\n",
    "shop/checkout.py": textwrap.dedent("""\
        from .rates.table import RATES


        def total(items):
            return sum(items) * RATES["standard"]
        """),
    "shop/prices.csv": "item,price\napple,3\n",
    "shop/rates/__init__.py": "",
    "shop/rates/table.py": "from . import info\nRATES = {'standard': 2}\n",
    "shop/rates/info.py": "NOTE = 'rates'\n",
    "shop/rates/info.txt": "rates are per item\n",
    "plugins/extra/tax.py": "RATE = 0.25\n",  # plugins/ and extra/ have no __init__.py
}

EXPECTED = {
    "total": 14, "rates": {"standard": 2}, "tax": 0.25, "data": "item,price\napple,3\n",
    "packaged": "rates are per item\n", "namespace": ["/src/plugins"],
    "file": "/src/helpers.py", "spec": 42, "runpy": 10, "open_code": "# helpers",
    "fileio": "item,price\napple,3\n", "os_open": "# helpers", "tokenize": "# helpers\n",
    "linecache": "def total(items):\n",
}


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    for name, text in PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def run_project(project: Path, backend: str, *args: str, stdin: str = "rows\n",
                env: dict[str, str] | None = None) -> wasibox.RunResult:
    limits = wasibox.Limits(timeout_s=60.0, fuel=60 * 10**9)
    with wasibox.Sandbox(limits, backend=backend, allow_emulation=True,  # type: ignore[arg-type]
                         mounts=[Mount(project, "/src")], python_path=["/src"]) as sandbox:
        return sandbox.run((project / "main.py").read_text(), filename="/src/main.py",
                           argv=["/src/main.py", *args], stdin=stdin,
                           env={"MODE": "test"} if env is None else env)


def check_report(stdout: str) -> None:
    report = json.loads(stdout)
    for key, value in EXPECTED.items():
        assert report[key] == value, key
    assert report["argv"] == ["/src/main.py", "--all"]
    assert report["env"] == {"MODE": "test"}
    assert report["stdin"] == "rows\n"
    assert report["main_file"] == "/src/main.py"


def test_a_multi_module_project_imports_and_runs_on_wasm(project: Path) -> None:
    result = run_project(project, "wasm", "--all")
    assert result.ok, result.error
    check_report(result.stdout)


def test_a_traceback_names_the_users_files_and_lines_and_no_runner_frame(
        project: Path) -> None:
    result = run_project(project, "wasm", "--all", "--fail")
    assert result.error is not None and result.error.type == "TypeError"
    trace = result.error.traceback
    assert f'File "/src/main.py", line {FAIL_LINE}, in <module>' in trace
    assert 'File "/src/shop/checkout.py", line 5, in total' in trace
    assert "return sum(items) * RATES" in trace  # the line's text, read through the mount
    assert "<sandbox>" not in trace and "wasibox" not in trace and "frozen" not in trace


def test_the_runner_hides_its_frames_from_errors_raised_inside_file_functions(
        project: Path) -> None:
    with wasibox.Sandbox(mounts=[Mount(project, "/src")]) as sandbox:
        result = sandbox.run("def main():\n    open('/src/nope.txt')\nmain()\n",
                             filename="/src/run.py")
    assert result.error is not None and result.error.type == "FileNotFoundError"
    lines = [line for line in result.error.traceback.splitlines() if "File " in line]
    assert lines == ['  File "/src/run.py", line 3, in <module>',
                     '  File "/src/run.py", line 2, in main']


def test_sys_path_insert_in_the_guest_imports_from_a_mount(project: Path) -> None:
    with wasibox.Sandbox(mounts=[Mount(project, "/src")]) as sandbox:
        result = sandbox.run("import sys\nsys.path.insert(0, '/src')\n"
                             "import helpers, shop\n"
                             "print(helpers.double(4), shop.checkout.total([1]))")
        plain = sandbox.run("import helpers")  # nothing on sys.path: not found
    assert result.ok, result.error
    assert result.stdout == "8 2\n"
    assert plain.error is not None and plain.error.type == "ModuleNotFoundError"


def test_a_user_module_cannot_shadow_the_standard_library(tmp_path: Path) -> None:
    (tmp_path / "json.py").write_text("raise SystemExit('shadowed')\n")
    with wasibox.Sandbox(mounts=[Mount(tmp_path, "/src")], python_path=["/src"]) as sandbox:
        result = sandbox.run("import json\nprint(json.dumps([1]))")
    assert result.ok and result.stdout == "[1]\n", result


@pytest.mark.microvm
@pytest.mark.usefixtures("vm_runtime")  # skips only where QEMU or the image is absent
def test_the_microvm_gives_the_same_output_as_wasm(project: Path) -> None:
    on_wasm = run_project(project, "wasm", "--all")
    on_vm = run_project(project, "microvm", "--all")
    assert on_vm.ok, on_vm.error
    assert on_vm.backend == "microvm"
    check_report(on_vm.stdout)
    assert on_vm.stdout == on_wasm.stdout
    failed_wasm = run_project(project, "wasm", "--all", "--fail")
    failed_vm = run_project(project, "microvm", "--all", "--fail")
    assert failed_vm.error is not None and failed_wasm.error is not None
    # The image's Python may be another version than the guest's, which marks the failing
    # expression with other carets: compare the frames and lines themselves.
    assert without_carets(failed_vm.error.traceback) == \
        without_carets(failed_wasm.error.traceback)


def without_carets(traceback: str) -> list[str]:
    return [line for line in traceback.splitlines() if line.strip(" ~^")]


# -- stdin, argv and environment --------------------------------------------------------------

@pytest.fixture(scope="module")
def plain() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox() as sandbox:
        yield sandbox


ECHO = "import json, os, sys\nprint(json.dumps([sys.stdin.read(), sys.argv, dict(os.environ)]))"


@settings(max_examples=25, deadline=None)
@given(stdin=st.text(st.characters(exclude_categories=["Cs"]), max_size=200),
       argv=st.lists(st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
                             max_size=20), max_size=4),
       env=st.dictionaries(
           st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00="),
                   min_size=1, max_size=10),
           st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
                   max_size=20), max_size=4))
def test_stdin_argv_and_env_reach_the_guest_exactly(
        plain: wasibox.Sandbox, stdin: str, argv: list[str], env: dict[str, str]) -> None:
    result = plain.run(ECHO, stdin=stdin, argv=argv, env=env)
    assert result.ok, result.error
    assert json.loads(result.stdout) == [stdin, argv, env]


def test_stdin_may_be_bytes_and_the_defaults_give_nothing(plain: wasibox.Sandbox) -> None:
    assert plain.run("import sys\nprint(sys.stdin.buffer.read())", stdin=b"\xc3\xa9\n").stdout \
        == "b'\\xc3\\xa9\\n'\n"
    default = plain.call("import os\ndef f():\n    return dict(os.environ)", "f")
    assert default == {}


@pytest.mark.parametrize(("options", "message"), [
    ({"stdin": 3}, "stdin must be str or bytes"),
    ({"stdin": "\ud800"}, "valid UTF-8"),
    ({"stdin": b"x" * (16 * 1024 + 1)}, "over 16 times the source_bytes"),
    ({"argv": "main.py"}, "argv must be a list of str"),
    ({"argv": ["a\x00b"]}, "NUL"),
    ({"env": {"A=B": "1"}}, "hold no '='"),
    ({"env": {"A": 1}}, "env values must be str"),
    ({"env": ["A"]}, "env must be a mapping"),
    ({"filename": ""}, "filename must not be empty"),
])
def test_bad_program_input_is_a_usage_error(options: dict[str, object], message: str) -> None:
    with wasibox.Sandbox(wasibox.Limits(source_bytes=1024)) as sandbox, \
            pytest.raises(UsageError, match=message):
        sandbox.run("pass", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("python_path", ["/src", ["src"], [b"/src"]])
def test_python_path_must_list_absolute_guest_paths(python_path: object) -> None:
    with pytest.raises(UsageError, match="python_path"):
        wasibox.Sandbox(python_path=python_path)  # type: ignore[arg-type]


def test_arun_and_start_take_the_same_program_input(plain: wasibox.Sandbox) -> None:
    result = asyncio.run(plain.arun(ECHO, stdin="in", argv=["x"], env={"K": "v"}))
    assert json.loads(result.stdout) == ["in", ["x"], {"K": "v"}]
    handle = plain.start(ECHO, stdin=b"b", argv=[], env={})
    assert json.loads(handle.result().stdout) == ["b", [], {}]


# -- the CLI ------------------------------------------------------------------------------------

def test_wasibox_run_runs_a_project_with_its_arguments_stdin_and_env(project: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--mount", f"{project}:/src", "--env", "MODE=test",
         str(project / "main.py"), "--all"],
        input="rows\n", capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    check_report(done.stdout)
    failed = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--mount", f"{project}:/src", "--no-stdin",
         str(project / "main.py"), "--fail"],
        capture_output=True, text=True, env=child_env(), timeout=300)
    assert failed.returncode == 1
    assert 'File "/src/shop/checkout.py", line 5, in total' in failed.stderr
    assert json.loads(failed.stdout)["stdin"] == ""


def test_wasibox_run_passes_only_the_environment_it_is_told_to(tmp_path: Path) -> None:
    env = dict(child_env(), WASIBOX_TEST_TOKEN="host-only", PASSED="yes")
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--env", "PASSED", "-c",
         "import os, sys; print(dict(os.environ), sys.argv)"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert done.stdout == "{'PASSED': 'yes'} ['-c']\n", done.stderr
    missing = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--env", "WASIBOX_NOT_SET_ANYWHERE", "-c", "pass"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert missing.returncode == 2 and "--env WASIBOX_NOT_SET_ANYWHERE=VALUE" in missing.stderr
    extra = subprocess.run([PYTHON, "-m", "wasibox", "run", "-c", "pass", "stray"],
                           capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                           timeout=300)
    assert extra.returncode == 2 and "not allowed with argument -c" in extra.stderr


def test_a_script_outside_every_mount_is_named_by_its_file_name(tmp_path: Path) -> None:
    script = tmp_path / "alone.py"
    script.write_text("import sys\nprint(__file__, sys.argv)\n1 / 0\n")
    done = subprocess.run([PYTHON, "-m", "wasibox", "run", str(script), "x"],
                          capture_output=True, text=True, env=child_env(),
                          stdin=subprocess.DEVNULL, timeout=300)
    assert done.stdout == "alone.py ['alone.py', 'x']\n"
    assert 'File "alone.py", line 3, in <module>' in done.stderr
    assert str(tmp_path) not in done.stdout + done.stderr


def test_a_transform_imports_the_users_modules_from_python_path(project: Path) -> None:
    code = "from shop.checkout import total\n\ndef t(record):\n    return total(record)\n"
    transform = wasibox.Transform(code, entry="t", mounts=[Mount(project, "/src")],
                                  python_path=["/src"])
    assert transform.map([[1, 2], [3]], progress=False) == [6, 6]


def test_wasibox_transform_and_fuzz_put_the_scripts_mount_first(project: Path,
                                                               tmp_path: Path) -> None:
    (project / "clean.py").write_text(
        "from shop.checkout import total\n\n\ndef transform(record):\n"
        "    return {'total': total(record['items'])}\n\n\n"
        "def check(n: int) -> int:\n    return total([n])\n")
    (tmp_path / "in.jsonl").write_text('{"items": [1, 2]}\n{"items": [5]}\n')
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "transform", "--mount", f"{project}:/src",
         str(project / "clean.py"), str(tmp_path / "in.jsonl"), "-"],
        capture_output=True, text=True, env=child_env(), stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [{"total": 6},
                                                                       {"total": 10}]
    replayed = subprocess.run(
        [PYTHON, "-m", "wasibox", "fuzz", "--mount", f"{project}:/src",
         str(project / "clean.py"), "--entry", "check", "--replay", "(4,)"],
        capture_output=True, text=True, env=child_env(), stdin=subprocess.DEVNULL, timeout=300)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert json.loads(replayed.stdout)["value"] == 8


def test_a_fuzz_failures_replay_line_carries_the_mounts(project: Path) -> None:
    import shlex

    from wasibox.testing import fuzz

    script = project / "check.py"
    script.write_text("from helpers import double\n\n\ndef check(n: int) -> int:\n"
                      "    assert double(n) < 10\n    return n\n")
    report = fuzz(script.read_text(), "check", max_examples=30, path=str(script),
                  mounts=[Mount(project, "/src"), Mount.scratch("/tmp")],
                  python_path=["/src"])
    assert not report.ok
    line = shlex.split(report.failures[0].replay)
    assert line[line.index("--mount") + 1] == f"{project}:/src" and line.count("--mount") == 1
    replayed = subprocess.run([PYTHON, "-m", "wasibox", *line[1:]], capture_output=True,
                              text=True, env=child_env(), stdin=subprocess.DEVNULL, timeout=300)
    assert replayed.returncode == 1
    assert json.loads(replayed.stdout)["error"]["type"] == "AssertionError"


def test_wasibox_run_refuses_a_stdin_over_the_limit_without_reading_all_of_it() -> None:
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "-c", "pass"], input=b"x" * (16 * 2**20 + 1),
        capture_output=True, env=child_env(), timeout=300)
    assert done.returncode == 2
    assert b"stdin is 16777217 bytes, over 16 times the source_bytes limit" in done.stderr
