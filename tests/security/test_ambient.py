"""Ambient leakage: nothing of the host reaches the guest unless it was granted.

A canary secret is put in the host's environment, then every place a guest (or the person
reading its result) could find host state is searched for it and for host absolute paths.
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime

import wasibox
from tests.security.conftest import HostBaseline
from wasibox._guest import cache_dir

pytestmark = pytest.mark.guest

CANARY = "wasibox-canary-4f1d8e2a9b7c"
LIMITS = wasibox.Limits(fuel=800_000_000, memory_bytes="96MiB", timeout_s=10,
                        output_bytes=256 * 1024)

#: Everything a guest can read about its process and interpreter.
INTROSPECT = r"""
import gc, linecache, os, sys, sysconfig
print("environ", dict(os.environ))
print("argv", sys.argv, sys.orig_argv)
print("interpreter", sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix)
print("path", sys.path, sys.meta_path, sys.path_hooks)
try:
    print("cwd", os.getcwd())
except OSError as exc:
    print("cwd", exc)
print("uname", os.uname())
for name, module in sorted(sys.modules.items()):
    print("module", name, getattr(module, "__file__", None))
print("code", sorted({o.__code__.co_filename for o in gc.get_objects() if hasattr(o, "__code__")}))
print("linecache", list(linecache.cache))
print("sysconfig", sysconfig.get_paths(), sysconfig.get_config_vars())
"""

#: Runs that fail in every way a run can fail, so every kind of error message is produced.
FAILURES = {
    "guest exception": "def inner():\n    raise ValueError('boom')\ninner()",
    "error inside the runner's own helpers": "import time\ntime.sleep(-1)",
    "unavailable module": "import ctypes",
    "missing file": "open('/etc/passwd')",
    "no root directory": "import os\nos.listdir('/')",
    "no processes": "import subprocess\nsubprocess.run(['id'])",
    "no sockets": "import socket\nsocket.create_connection(('127.0.0.1', 22))",
    "recursion": "def f():\n    return f()\nf()",
    "wasm stack exhausted": "import json\njson.loads('[' * 10**6 + ']' * 10**6)",
    "fuel": "while True: pass",
    "memory": "x = bytearray(2**30)",
    "output": "while True: print('x' * 1000)",
    "exit status": "import sys\nsys.exit('leaving')",
    "os._exit": "import os\nos._exit(3)",
    "trap inside the guest": ("import sys\nstdio = sys.modules['wit_world.imports.stdio']\n"
                              "stdio.write(1, 'x' * (90 * 2**20))"),
    "forged reply": ("import sys\nsys.modules['wasibox_job'].encode_reply = "
                     "lambda fields: 'not base64!'"),
    "refused entropy request": ("import sys\nsys.modules['wit_world.imports.entropy']"
                                ".random_bytes(2**30)"),
}


def host_paths() -> set[str]:
    """Absolute paths on this host that a leak would most likely show."""
    candidates = {
        Path.home(), Path(tempfile.gettempdir()), Path(sys.prefix), Path(sys.base_prefix),
        Path(sys.executable).parent, Path(wasibox.__file__).parent.parent,
        Path(wasmtime.__file__).parent, cache_dir(), Path.cwd(),
        Path(sysconfig.get_paths()["purelib"]),
    }
    return {str(path) for path in candidates if str(path) not in ("/", "")}


def result_text(result: wasibox.RunResult) -> str:
    parts = [result.stdout, result.stderr]
    if result.error is not None:
        parts += [result.error.type, result.error.message, result.error.traceback]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(LIMITS) as sandbox:
        yield sandbox


@pytest.fixture(autouse=True)
def canary_in_host_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_CANARY_SECRET", CANARY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY)
    assert os.environ["WASIBOX_CANARY_SECRET"] == CANARY


def test_the_guest_sees_no_environment_arguments_or_host_directory(
        sb: wasibox.Sandbox, host: HostBaseline) -> None:
    r = sb.call("import os, sys\ndef f():\n    try:\n        cwd = os.getcwd()\n"
                "    except OSError:\n        cwd = None\n"
                "    return [dict(os.environ), sys.argv, sys.orig_argv, sys.path, cwd]", "f")
    # argv and sys.path are [''], as for `python -c` (argparse needs argv[0]); nothing of
    # the host's.
    assert r == [{}, [""], [], [""], "/"]
    host.assert_unaffected(sb)


def test_nothing_the_guest_can_introspect_holds_the_canary_or_a_host_path(
        sb: wasibox.Sandbox, host: HostBaseline) -> None:
    r = sb.run(INTROSPECT)
    assert r.ok, r.error
    assert "environ {}" in r.stdout and "module wasibox_guest" in r.stdout  # it really ran
    assert CANARY not in r.stdout
    for path in host_paths():
        assert path not in r.stdout, path
    host.assert_unaffected(sb)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_no_error_output_or_traceback_holds_the_canary_or_a_host_path(
        sb: wasibox.Sandbox, host: HostBaseline, name: str) -> None:
    r = sb.run(FAILURES[name])
    assert not r.ok, name
    text = result_text(r)
    assert CANARY not in text
    for path in host_paths():
        assert path not in text, (name, path, text[:500])
    host.assert_unaffected(sb)


def test_the_result_as_json_holds_no_host_path(sb: wasibox.Sandbox) -> None:
    text = repr(sb.run(FAILURES["guest exception"]).to_dict())
    for path in host_paths():
        assert path not in text


def test_one_run_leaves_nothing_for_the_next(sb: wasibox.Sandbox, host: HostBaseline) -> None:
    planted = sb.run(f"""
import builtins, json, os, sys
builtins.SECRET = {CANARY!r}
json.SECRET = {CANARY!r}
sys.modules['planted'] = type(sys)('planted')
os.environ['SECRET'] = {CANARY!r}
sys.path.append({CANARY!r})
""")
    assert planted.ok
    probe = sb.run("import builtins, json, os, sys\n"
                   "print(hasattr(builtins, 'SECRET'), hasattr(json, 'SECRET'),\n"
                   "      'planted' in sys.modules, 'SECRET' in os.environ, sys.path)")
    assert probe.stdout == "False False False False ['']\n"
    host.assert_unaffected(sb)


def test_the_guest_has_no_network_authority(sb: wasibox.Sandbox, host: HostBaseline) -> None:
    # Loopback canaries: any packet or connection that reached them would be a leak.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(("127.0.0.1", 0))
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp_port, tcp_port = udp.getsockname()[1], tcp.getsockname()[1]
        attempts = {
            "tcp connect": f"s = socket.socket()\ns.connect(('127.0.0.1', {tcp_port}))",
            "udp send": (f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                         f"s.sendto(b'{CANARY}', ('127.0.0.1', {udp_port}))"),
            "listen": "s = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()",
            "dns": "socket.getaddrinfo('localhost', 80)",
            "urllib": f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{tcp_port}/')",
        }
        for name, code in attempts.items():
            r = sb.run("import socket\n" + code)
            assert r.error is not None, name
            # urlopen now goes through the HTTP capability, which is not granted here.
            assert r.error.type in ("PermissionError", "gaierror", "URLError",
                                    "CapabilityDenied"), (name, r.error)
        udp.setblocking(False)
        tcp.setblocking(False)
        with pytest.raises(BlockingIOError):
            udp.recvfrom(1024)
        with pytest.raises(BlockingIOError):
            tcp.accept()
    host.assert_unaffected(sb)
