"""Third-party packages: resolved on the host with pip, pure-Python wheels only, built into a
guest snapshot of their own (wasibox/_packages.py, guest/runner/wasibox_guest.py).

The guest tests fetch attrs and python-dateutil from PyPI (through pip's configuration) and
make a wheelhouse holding the pure-Python part of PyYAML (which publishes native wheels
only); they skip, naming PyPI, only when PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import NativeOnlyPackage, Packages, UsageError
from wasibox._cli import main
from wasibox._guest import cache_dir, file_sha256
from wasibox._packages import PackageSet, Wheel, guest_digest, recorded_set, resolve
from wasibox.services.config import parse_config

from .conftest import PYTHON, child_env

ROOT = Path(__file__).resolve().parent.parent


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


def _pure_pyyaml_wheelhouse(directory: Path) -> Path:
    """A wheelhouse with PyYAML's pure-Python part as a py3-none-any wheel.

    PyYAML publishes native wheels only; the pure part (yaml without its optional C loader)
    is every member but the extension modules. Repacking runs no package code.
    """
    native = directory / "native"
    subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:",
                    "--no-deps", "--dest", str(native), "--disable-pip-version-check",
                    "pyyaml==6.0.2"], check=True, capture_output=True)
    source = next(native.glob("*.whl"))
    version = source.name.split("-")[1]
    house = directory / "wheelhouse"
    house.mkdir()
    with zipfile.ZipFile(source) as wheel, \
            zipfile.ZipFile(house / f"PyYAML-{version}-py3-none-any.whl", "w") as pure:
        for info in wheel.infolist():
            if info.filename.endswith(".so"):
                continue
            data = wheel.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.startswith((b"Tag:", b"Root-Is-Purelib:")))
                data += b"Root-Is-Purelib: true\nTag: py3-none-any\n"
            # The member's own timestamp: the same native wheel makes the same pure one, so
            # the package set (and its built guest) is the same from one session to the next.
            pure.writestr(zipfile.ZipInfo(info.filename, date_time=info.date_time), data,
                          compress_type=zipfile.ZIP_DEFLATED)
    return house


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is unreachable: the package tests fetch wheels")
    return _pure_pyyaml_wheelhouse(tmp_path_factory.mktemp("pyyaml"))


@pytest.fixture(scope="module")
def packages(wheelhouse: Path) -> Packages:
    return Packages(requirements=("attrs", "python-dateutil", "pyyaml==6.0.2"),
                    find_links=(str(wheelhouse),))


@pytest.fixture(scope="module")
def package_sandbox(packages: Packages) -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(packages=packages) as sandbox:
        yield sandbox


# -- guest ------------------------------------------------------------------------------------

USES_PACKAGES = """
import datetime, importlib.metadata
import attrs, yaml
from dateutil import parser, tz
from dateutil.relativedelta import relativedelta

@attrs.frozen
class Point:
    x: int
    y: int = 0

doc = yaml.safe_load("points: [{x: 1, y: 2}, {x: 3}]\\nwhen: 2024-01-31")
points = [Point(**p) for p in doc["points"]]
print(points, attrs.asdict(points[0]))
print(doc["when"] + relativedelta(months=+1))
print(parser.parse("2024-03-05T10:00:00+02:00").astimezone(tz.UTC).isoformat())
print(yaml.safe_dump({"b": [1, 2], "a": "x"}, sort_keys=True), end="")
print(yaml.__with_libyaml__, importlib.metadata.version("attrs") == attrs.__version__)
print(yaml.__file__)
"""


@pytest.mark.guest
def test_pure_packages_import_and_work_in_the_wasm_guest(
        package_sandbox: wasibox.Sandbox) -> None:
    result = package_sandbox.run(USES_PACKAGES)
    assert result.ok, result.error
    lines = result.stdout.splitlines()
    assert lines[0] == "[Point(x=1, y=2), Point(x=3, y=0)] {'x': 1, 'y': 2}"
    assert lines[1] == "2024-02-29"
    assert lines[2] == "2024-03-05T08:00:00+00:00"
    assert lines[3:5] == ["a: x", "b:"]
    # PyYAML's C loader is absent; its pure-Python part does the work.
    assert lines[-2] == "False True"
    assert lines[-1] == "<packages>/yaml/__init__.py"
    assert result.backend == "wasm"
    assert [pin.split("==")[0] for pin in result.packages] == \
        ["PyYAML", "attrs", "python_dateutil", "tzdata"]


@pytest.mark.guest
def test_the_package_set_is_imported_in_the_snapshot(
        package_sandbox: wasibox.Sandbox) -> None:
    importing = package_sandbox.run(
        "import yaml, attrs, dateutil.parser, dateutil.tz, dateutil.relativedelta\n"
        "print('ok')")
    plain = package_sandbox.run("print('ok')")
    assert importing.ok and plain.ok
    # The modules are in the snapshot already: importing them is a dict lookup each
    # (importing dateutil.parser at run time cost ~80 M fuel).
    assert importing.fuel_used - plain.fuel_used < 200_000


@pytest.mark.guest
def test_a_package_set_is_part_of_the_guest_identity(packages: Packages,
                                                     package_sandbox: wasibox.Sandbox) -> None:
    digest = guest_digest(packages)
    assert digest != guest_digest()
    assert digest == guest_digest(packages)  # cached, not rebuilt
    assert len(digest) == 64


@pytest.mark.guest
def test_two_processes_with_the_same_set_agree(packages: Packages,
                                               package_sandbox: wasibox.Sandbox) -> None:
    script = (
        "import json, sys, wasibox\n"
        "packages = wasibox.Packages(**json.loads(sys.argv[1]))\n"
        "with wasibox.Sandbox(packages=packages) as sb:\n"
        "    r = sb.run(sys.argv[2])\n"
        "print(json.dumps([r.stdout, r.fuel_used, r.packages]))\n")
    spec = json.dumps({"requirements": list(packages.requirements),
                       "find_links": list(packages.find_links)})
    code = USES_PACKAGES + "import random\nprint(random.random())\n"
    outputs = [subprocess.run([PYTHON, "-c", script, spec, code], env=child_env(),
                              capture_output=True, text=True, check=True, timeout=300).stdout
               for _ in range(2)]
    first, second = (json.loads(output) for output in outputs)
    assert first == second
    assert "Point(x=1, y=2)" in first[0] and first[1] > 0


@pytest.mark.guest
def test_the_guest_reads_no_host_file_outside_its_mounts(
        package_sandbox: wasibox.Sandbox, packages: Packages, tmp_path: Path) -> None:
    package_set = resolve(packages)
    targets = [str(package_set.wheel_path(wheel)) for wheel in package_set.wheels]
    targets += [str(cache_dir()), str(ROOT / "pyproject.toml"), "/etc/passwd",
                str(packages.find_links[0])]
    (tmp_path / "mine.txt").write_text("mine")
    code = (
        "import os, sys, io\n"
        "for path in sys.argv[1:]:\n"
        "    for reader in (lambda p: open(p, 'rb').read(1), os.listdir, io.open_code,\n"
        "                   lambda p: os.stat(p)):\n"
        "        try:\n"
        "            reader(path)\n"
        "        except OSError:\n"
        "            continue\n"
        "        print('READ', path)\n"
        "print(open('/data/mine.txt').read())\n")
    with wasibox.Sandbox(packages=packages, mounts=[wasibox.Mount(tmp_path, "/data")]) as sb:
        result = sb.run(code, argv=["x", *targets])
    assert result.ok, result.error
    assert result.stdout == "mine\n"


@pytest.mark.guest
def test_transforms_and_fuzzing_take_packages(packages: Packages,
                                              package_sandbox: wasibox.Sandbox) -> None:
    from wasibox.testing import GuestFunction, fuzz

    code = ("import yaml\n\ndef transform(n: int) -> object:\n"
            "    return yaml.safe_load(f'[{n}, {{k: {n}}}]')\n")
    with wasibox.Transform(code, "transform", packages=packages) as transform:
        assert transform.map([1, -2]) == [[1, {"k": 1}], [-2, {"k": -2}]]
    function = GuestFunction(code, "transform", packages=packages)
    assert function(7) == [7, {"k": 7}]
    assert "--package" in function.package_flags()
    assert "PyYAML==6.0.2" in function.package_flags()
    function.close()
    report = fuzz(code, "transform", max_examples=10, packages=packages)
    assert report.ok and report.examples == 10


# -- errors -----------------------------------------------------------------------------------


def test_a_native_only_package_is_refused_naming_it(tmp_path: Path) -> None:
    if not _pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is unreachable: this test asks it for orjson")
    with pytest.raises(NativeOnlyPackage) as caught:
        wasibox.Sandbox(packages=["orjson"])
    assert caught.value.package == "orjson"
    assert "only native wheels" in str(caught.value)
    assert isinstance(caught.value, UsageError)
    with pytest.raises(NativeOnlyPackage, match="orjson"):
        wasibox.Sandbox(packages=["orjson"], backend="auto")


def _native_wheelhouse(directory: Path, project: str) -> Path:
    """A wheelhouse with one native wheel of ``project`` for this host (and no pure one)."""
    import sysconfig

    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    house = directory / "native-wheelhouse"
    house.mkdir()
    dist_info = f"{project}-2.0.0.dist-info"
    with zipfile.ZipFile(house / f"{project}-2.0.0-py3-none-{platform}.whl", "w") as wheel:
        wheel.writestr(f"{project}/__init__.py", "")
        wheel.writestr(f"{dist_info}/METADATA",
                       f"Metadata-Version: 2.1\nName: {project}\nVersion: 2.0.0\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                             f"Tag: py3-none-{platform}\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return house


def test_a_native_only_package_the_microvm_has_points_there(tmp_path: Path) -> None:
    from wasibox.backends.microvm.runtime import vm_modules

    if "numpy" not in vm_modules():
        pytest.skip("this machine's microVM image configuration has no numpy")
    house = _native_wheelhouse(tmp_path, "numpy")
    wanted = Packages(requirements=("numpy",), find_links=(str(house),), no_index=True)
    with pytest.raises(NativeOnlyPackage) as caught:
        wasibox.Sandbox(packages=wanted)
    assert caught.value.package == "numpy"
    assert "only native wheels (such as numpy-2.0.0-py3-none-" in str(caught.value)
    assert "The microVM image has numpy already: leave it out of packages and run on the " \
        "microVM" in str(caught.value)
    with pytest.raises(UsageError, match="the microVM does not install packages"):
        wasibox.Sandbox(packages=wanted, backend="microvm")


def test_packages_need_the_wasm_guest() -> None:
    with pytest.raises(UsageError, match="microVM does not install packages"):
        wasibox.Sandbox(packages=["attrs"], backend="microvm")


def test_a_package_that_pip_cannot_find_is_a_usage_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no wheel of no-such-package-wasibox"):
        wasibox.Sandbox(packages=Packages(requirements=("no-such-package-wasibox",),
                                          find_links=(str(empty),), no_index=True))


@pytest.mark.parametrize("requirement", [
    "https://example.com/x.tar.gz", "./local", "/abs/path", "--index-url=http://x",
    "-e .", "x @ https://example.com/x.whl", "x; python_version<'3'", "", "a b", "x==1 --pre",
])
def test_requirements_are_names_and_versions_only(requirement: str) -> None:
    with pytest.raises(UsageError, match="not a package requirement"):
        Packages(requirements=(requirement,))


@given(st.text(max_size=40))
def test_an_accepted_requirement_can_only_name_a_project(text: str) -> None:
    try:
        Packages(requirements=(text,))
    except UsageError:
        return
    # What is accepted reaches pip as one argument that is no option, URL or path.
    accepted = text.strip()
    assert accepted and not accepted.startswith("-")
    assert not set(accepted) & set("/\\:@;\x00\n")


def test_packages_must_be_a_list() -> None:
    with pytest.raises(UsageError, match="list of requirements"):
        wasibox.Sandbox(packages="attrs")  # type: ignore[arg-type]


# -- unpacking hostile wheels -------------------------------------------------------------------


def _cached_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                members: dict[str, bytes], symlink: str | None = None) -> PackageSet:
    """A package set of one wheel with these members, placed in a private cache."""
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(source, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (0o120777 << 16)
            archive.writestr(info, "/etc/passwd")
    wheel = Wheel("evil", "1.0", source.name, file_sha256(source))
    package_set = PackageSet((wheel,), "0" * 64)
    kept = package_set.wheel_path(wheel)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(source.read_bytes())
    return package_set


@pytest.mark.parametrize("name", ["../escape.py", "/abs.py", "evil/../../escape.py",
                                  "C:/x.py", "evil\\..\\x.py"])
def test_unpacking_refuses_paths_outside_the_site(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path, name: str) -> None:
    package_set = _cached_set(monkeypatch, tmp_path, {"evil/__init__.py": b"", name: b"x"})
    site = tmp_path / "build" / "site"
    with pytest.raises(UsageError, match="unsafe path"):
        package_set.unpack(site)
    assert not (tmp_path / "escape.py").exists()
    assert not (tmp_path / "build" / "escape.py").exists()


_MEMBER = st.lists(st.sampled_from(["..", ".", "", "a", "b.py", "C:", "x\\..", "/", "\x00",
                                     "a.data", "purelib", "__pycache__", "m.so"]),
                   min_size=1, max_size=5).map("/".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(_MEMBER, min_size=1, max_size=4, unique=True))
def test_unpacking_writes_only_inside_the_site(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        with pytest.MonkeyPatch.context() as monkeypatch:
            try:
                package_set = _cached_set(monkeypatch, root, dict.fromkeys(names, b"x"))
            except (ValueError, IndexError, FileExistsError, UserWarning):
                # A name zipfile itself cannot write, or two that it writes as one (it cuts
                # a name at NUL, and its duplicate-name warning is an error in this suite).
                return
            site = root / "build" / "site"
            site.mkdir(parents=True)
            try:
                package_set.unpack(site)
            except UsageError:
                pass
        written = {path for path in root.rglob("*") if path.is_file()}
        outside = {path for path in written if site not in path.parents
                   and (root / "cache") not in path.parents and path.suffix != ".whl"}
        assert not outside


def test_unpacking_refuses_symlinks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package_set = _cached_set(monkeypatch, tmp_path, {"evil/__init__.py": b""},
                              symlink="evil/passwd")
    with pytest.raises(UsageError, match="symlink"):
        package_set.unpack(tmp_path / "site")
    assert not (tmp_path / "site" / "evil" / "passwd").exists()


def test_unpacking_keeps_pure_python_only(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    package_set = _cached_set(monkeypatch, tmp_path, {
        "evil/__init__.py": b"x = 1\n", "evil/_speed.cpython-311-x86_64-linux-gnu.so": b"\x7fELF",
        "evil/data.json": b"{}", "evil-1.0.data/purelib/extra.py": b"",
        "evil-1.0.data/scripts/run": b"#!/bin/sh\n", "evil-1.0.dist-info/METADATA": b"Name: evil\n",
    })
    site = tmp_path / "site"
    package_set.unpack(site)
    found = sorted(str(path.relative_to(site)) for path in site.rglob("*") if path.is_file())
    assert found == ["evil-1.0.dist-info/METADATA", "evil/__init__.py", "evil/data.json",
                     "extra.py"]


def test_a_changed_cached_wheel_is_never_used(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    package_set = _cached_set(monkeypatch, tmp_path, {"evil/__init__.py": b""})
    package_set.wheel_path(package_set.wheels[0]).write_bytes(b"tampered")
    with pytest.raises(UsageError, match="does not match its recorded sha256"):
        package_set.unpack(tmp_path / "site")


def test_the_set_digest_follows_the_wheels() -> None:
    from wasibox._packages import _package_set

    a = Wheel("a", "1", "a-1-py3-none-any.whl", "1" * 64)
    b = Wheel("b", "1", "b-1-py3-none-any.whl", "2" * 64)
    assert _package_set([a, b]).digest == _package_set([b, a]).digest
    assert _package_set([a]).digest != _package_set([a, b]).digest
    changed = Wheel("a", "1", "a-1-py3-none-any.whl", "3" * 64)
    assert _package_set([changed, b]).digest != _package_set([a, b]).digest


# -- CLI and configuration ----------------------------------------------------------------------


@pytest.mark.guest
def test_cli_run_prepare_and_doctor_name_the_set(
        packages: Packages, package_sandbox: wasibox.Sandbox,
        capsys: pytest.CaptureFixture[str]) -> None:
    links = [arg for link in packages.find_links for arg in ("--find-links", link)]
    flags = [arg for requirement in packages.requirements for arg in ("--package", requirement)]
    assert main(["prepare", *flags, *links]) == 0
    prepared = capsys.readouterr().out
    assert f"guest sha256 {guest_digest(packages)}" in prepared
    assert "package set " in prepared and "attrs==" in prepared
    assert main(["run", "--no-stdin", *flags, *links, "-c",
                 "import yaml; print(yaml.safe_load('[1, 2]'))"]) == 0
    assert capsys.readouterr().out == "[1, 2]\n"
    assert main(["doctor"]) == 0
    doctor = capsys.readouterr().out
    assert any(line.startswith("package set") and "PyYAML==6.0.2" in line
               for line in doctor.splitlines())


def test_cli_package_index_flags_need_packages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--no-stdin", "--no-index", "-c", "pass"]) != 0
    assert "add the packages with --package" in capsys.readouterr().err


def test_config_takes_packages_and_python_path(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    config = parse_config({"tenants": {"a": {
        "packages": ["attrs==26.1.0"], "package_find_links": ["wheels"],
        "package_no_index": True, "python_path": ["/src"]}}}, base_dir=tmp_path)
    options = config.tenants["a"].sandbox_options()
    assert options["python_path"] == ["/src"]
    assert options["packages"] == Packages(requirements=("attrs==26.1.0",),
                                           find_links=(str(tmp_path / "wheels"),),
                                           no_index=True)


@pytest.mark.parametrize(("tenant", "key"), [
    ({"packages": ["https://example.com/x.whl"]}, "tenants.a"),
    ({"package_no_index": True}, "tenants.a"),
    ({"python_path": ["src"]}, "tenants.a.python_path[0]"),
])
def test_config_refuses_bad_packages_naming_the_key(tenant: dict[str, object],
                                                    key: str) -> None:
    with pytest.raises(wasibox.ConfigError, match=re.escape(key)):
        parse_config({"tenants": {"a": tenant}})


def test_no_package_code_runs_on_the_host(tmp_path: Path) -> None:
    """A wheelhouse holding only a source distribution whose setup.py would leave a mark:
    resolving refuses it, and the mark is never made."""
    house = tmp_path / "house"
    house.mkdir()
    mark = tmp_path / "ran"
    project = tmp_path / "marker-1.0"
    project.mkdir()
    (project / "setup.py").write_text(f"open({str(mark)!r}, 'w').close()\n"
                                      "from setuptools import setup\nsetup(name='marker', "
                                      "version='1.0')\n")
    with tarfile.open(house / "marker-1.0.tar.gz", "w:gz") as archive:
        archive.add(project, arcname="marker-1.0")
    with pytest.raises(UsageError, match="no wheel of marker"):
        resolve(Packages(requirements=("marker",), find_links=(str(house),), no_index=True))
    assert not mark.exists()
    assert os.listdir(house) == ["marker-1.0.tar.gz"]


# -- journals of a package set ------------------------------------------------------------------

PACKAGE_PROGRAM = """
import datetime, random
import attrs, yaml
from dateutil.relativedelta import relativedelta

def main(n):
    doc = yaml.safe_load(f"items: [{n}, {n * 2}]")
    when = datetime.date(2024, 1, 31) + relativedelta(months=+n)
    print(doc, when, random.random())
    return {"items": doc["items"], "when": when.isoformat(), "attrs": attrs.__version__}
"""


def _record_package_run(packages: Packages, journal: Path) -> dict[str, object]:
    """Record one call of PACKAGE_PROGRAM with ``packages`` into ``journal``, in a process of
    its own; its result as JSON."""
    script = (
        "import json, sys, wasibox\n"
        "packages = wasibox.Packages(**json.loads(sys.argv[1]))\n"
        "with wasibox.Sandbox(packages=packages) as sb:\n"
        "    r = sb.run(sys.argv[2], entry='main', args=[2], journal=sys.argv[3])\n"
        "print(json.dumps(r.to_dict()))\n")
    spec = json.dumps({"requirements": list(packages.requirements),
                       "find_links": list(packages.find_links)})
    done = subprocess.run([PYTHON, "-c", script, spec, PACKAGE_PROGRAM, str(journal)],
                          env=child_env(), capture_output=True, text=True, check=True,
                          timeout=300)
    recorded: dict[str, object] = json.loads(done.stdout)
    return recorded


@pytest.mark.guest
def test_a_journal_of_a_package_set_replays_offline_in_another_process(
        packages: Packages, package_sandbox: wasibox.Sandbox, tmp_path: Path) -> None:
    journal = tmp_path / "packages.jsonl"
    recorded = _record_package_run(packages, journal)
    value = recorded["value"]
    assert recorded["ok"] and isinstance(value, dict)
    assert value["items"] == [2, 4] and value["when"] == "2024-03-31"
    header = json.loads(journal.read_text().splitlines()[0])
    package_set = resolve(packages)
    assert header["packages"] == list(package_set.pins)
    assert header["wheels"] == package_set.records()
    assert header["guest_digest"] == guest_digest(packages) != guest_digest()
    # Offline: pip is told to use no index, so a replay that resolved anything would fail.
    env = {**child_env(), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([PYTHON, "-m", "wasibox", "replay", "--json", str(journal)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    (call,) = json.loads(done.stdout)["calls"]
    assert call["differences"] == []
    replayed = call["result"]
    for name in ("stdout", "value", "fuel_used", "exit_code", "packages"):
        assert replayed[name] == recorded[name], name


@pytest.mark.guest
def test_replaying_a_package_set_whose_wheels_are_not_cached_names_them_and_the_fix(
        packages: Packages, package_sandbox: wasibox.Sandbox, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    journal = wasibox.Journal()
    package_sandbox.run("import attrs; print(attrs.__version__)", journal=journal)
    path = tmp_path / "packages.jsonl"
    journal.save(path)
    package_set = resolve(packages)
    # Another machine's cache: one wheel is there but altered, the others are missing.
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path / "cache"))
    altered = package_set.wheels[0]
    package_set.wheel_path(altered).parent.mkdir(parents=True)
    package_set.wheel_path(altered).write_bytes(b"not the recorded wheel")
    with pytest.raises(wasibox.JournalError) as caught:
        wasibox.replay(path)
    message = str(caught.value)
    assert not isinstance(caught.value, wasibox.GuestDigestMismatch)
    for wheel in package_set.wheels:
        assert wheel.filename in message
    assert "wasibox prepare " + " ".join(f"--package {pin}" for pin in package_set.pins) \
        in message
    assert str(tmp_path) not in message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({
    "filename": st.one_of(st.text(max_size=40), st.from_regex(
        r"[A-Za-z0-9./\\_+!-]{1,12}-[0-9.]{1,5}-py3-none-any\.whl", fullmatch=True)),
    "sha256": st.one_of(st.text(max_size=70), st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
}), max_size=3))
def test_a_journals_wheels_name_only_files_inside_the_package_cache(
        records: list[dict[str, str]]) -> None:
    try:
        package_set = recorded_set(records)
    except ValueError:
        return
    wheels = cache_dir() / "packages" / "wheels"
    for wheel in package_set.wheels:
        path = package_set.wheel_path(wheel)
        assert path.parent.parent == wheels and ".." not in path.parts
        assert path.name == wheel.filename and "/" not in wheel.filename


@pytest.mark.guest
def test_a_package_set_sessions_snapshot_restores(package_sandbox: wasibox.Sandbox) -> None:
    with package_sandbox.session(journal=wasibox.Journal()) as session:
        assert session.run("import yaml\ndoc = yaml.safe_load('[1, 2]')").ok
        assert session.run("doc.append(len(doc) + 1)").ok
        snapshot = session.snapshot()
    with package_sandbox.session(restore=snapshot) as restored:
        assert restored.run("print(yaml.safe_dump(doc), end='')").stdout == "- 1\n- 2\n- 3\n"
    with wasibox.Sandbox() as plain, pytest.raises(wasibox.UsageError, match="wheels"):
        plain.session(restore=snapshot)  # a sandbox without the set cannot restore it
