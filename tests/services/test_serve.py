"""`wasibox serve` run for real: uvicorn on 127.0.0.1 in a subprocess, driven by httpx."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from wasibox.services.config import hash_token

from ..conftest import PYTHON, child_env

pytestmark = pytest.mark.guest

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token",
          "metered": "metered-secret-token", "narrow": "narrow-secret-token",
          "patient": "patient-secret-token", "files": "files-secret-token"}
MAX_BODY = 64 * 1024

CONFIG = f"""
[server]
max_body_bytes = {MAX_BODY}

[tenants.alice]
token_sha256 = "{hash_token(TOKENS['alice'])}"
limits = {{ fuel = 100_000_000, timeout_s = 5, source_bytes = "8KiB" }}
rate_limit = {{ per_second = 1000, burst = 1000 }}

[tenants.bob]
token_sha256 = "{hash_token(TOKENS['bob'])}"
seed = 7
limits = {{ fuel = 150_000_000 }}

[tenants.metered]
token_sha256 = "{hash_token(TOKENS['metered'])}"
rate_limit = {{ per_second = 0.01, burst = 2 }}

[tenants.narrow]
token_sha256 = "{hash_token(TOKENS['narrow'])}"
max_concurrency = 1
max_queue = 0
clock = "real"

[tenants.patient]
token_sha256 = "{hash_token(TOKENS['patient'])}"
max_concurrency = 1
clock = "real"
limits = {{ fuel = 1_000_000_000_000_000, timeout_s = 60 }}

[tenants.files]
token_sha256 = "{hash_token(TOKENS['files'])}"
python_path = ["/data"]

functions = {{ factorial = "math:factorial" }}
http = {{ allow = ["api.example.com"], methods = ["GET"] }}

[[tenants.files.mounts]]
host = "data"
guest = "/data"

[[tenants.files.mounts]]
host = "out"
guest = "/out"
writable = true
quota_bytes = "1MiB"
"""


class Server:
    """A live `wasibox serve` subprocess and what it has logged so far."""

    def __init__(self, config: Path) -> None:
        self.config_dir = str(config.parent)
        self.process = subprocess.Popen(
            [PYTHON, "-m", "wasibox", "serve", "--config", str(config), "--port", "0"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=child_env())
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        if not self._ready.wait(120):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def client(self, tenant: str | None = None, **kwargs: object) -> httpx.Client:
        headers = {"authorization": f"Bearer {TOKENS[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]

    def run_logs(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in list(self.lines) if line.startswith('{"event":"run"')]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._drainer.join(30)
        assert self.process.stderr is not None
        self.process.stderr.close()


def serving(config: Path) -> Iterator[Server]:
    """A live server for ``config`` until the generator is closed; then it must have
    stopped cleanly."""
    live = Server(config)
    yield live
    live.stop()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: that exit is the normal one.
    assert live.process.returncode in (0, -signal.SIGTERM), "".join(live.lines)
    assert "Traceback" not in "".join(live.lines)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    (root / "data").mkdir()
    (root / "data" / "greeting.txt").write_text("hello from the host")
    (root / "data" / "shout.py").write_text("def shout(text):\n    return text.upper()\n")
    (root / "out").mkdir()
    config = root / "wasibox.toml"
    config.write_text(CONFIG)
    yield from serving(config)


@pytest.fixture(scope="module")
def alice(server: Server) -> Iterator[httpx.Client]:
    with server.client("alice") as client:
        yield client


# -- endpoints --------------------------------------------------------------------------------

def test_healthz_needs_no_token(server: Server) -> None:
    with server.client() as client:
        response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_run_returns_the_run_result(alice: httpx.Client) -> None:
    response = alice.post("/v1/run", json={"code": "print(6 * 7)"})
    assert response.status_code == 200
    body = response.json()
    assert (body["ok"], body["stdout"], body["limit_exceeded"], body["backend"]) == (
        True, "42\n", None, "wasm")
    assert body["fuel_used"] > 0 and body["duration_s"] > 0


def test_call_returns_the_value(alice: httpx.Client) -> None:
    response = alice.post("/v1/call", json={
        "code": "def f(x, *, scale):\n    return {'y': x * scale, 'raw': b'ab'}",
        "entry": "f", "args": [4], "kwargs": {"scale": 10}})
    assert response.status_code == 200
    assert response.json()["value"] == {"y": 40, "raw": {"base64": "YWI="}}


def test_guest_errors_are_results_with_only_guest_frames(alice: httpx.Client) -> None:
    response = alice.post("/v1/call", json={
        "code": "def f():\n    raise ValueError('boom')", "entry": "f"})
    assert response.status_code == 200
    error = response.json()["error"]
    assert (error["type"], error["message"]) == ("ValueError", "boom")
    assert "ValueError: boom" in error["traceback"]
    assert_no_host_detail(response.text)


def test_the_tenants_limits_apply(alice: httpx.Client) -> None:
    body = alice.post("/v1/run", json={"code": "while True: pass"}).json()
    assert (body["ok"], body["limit_exceeded"], body["fuel_used"]) == (False, "fuel", 100_000_000)


def test_openapi_schema_describes_the_endpoints(server: Server) -> None:
    with server.client() as client:
        schema = client.get("/openapi.json").json()
    assert {"/v1/run", "/v1/call", "/healthz", "/metrics"} <= set(schema["paths"])
    run = schema["paths"]["/v1/run"]["post"]
    assert run["security"] and {"401", "413", "422", "429"} <= set(run["responses"])
    assert "RunResultModel" in schema["components"]["schemas"]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_metrics_in_prometheus_text_format(server: Server, alice: httpx.Client) -> None:
    alice.post("/v1/run", json={"code": "pass"})
    alice.post("/v1/run", json={"code": "while True: pass"})
    with server.client() as client:
        response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for needle in ('wasibox_runs_total{outcome="ok",tenant="alice"}',
                   'wasibox_runs_total{outcome="limit",tenant="alice"}',
                   'wasibox_limits_exceeded_total{limit="fuel",tenant="alice"}',
                   'wasibox_run_duration_seconds_bucket{le="0.5",tenant="alice"}',
                   'wasibox_queue_depth{tenant="narrow"}', 'wasibox_active_runs{tenant="bob"}',
                   "wasibox_pool_size ", "wasibox_pool_target_size "):
        assert needle in text, needle


# -- authentication and tenancy ---------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {}, {"authorization": "Bearer not-a-token"}, {"authorization": "Bearer"},
    {"authorization": f"Basic {TOKENS['alice']}"}, {"authorization": TOKENS["alice"]},
    {"authorization": f"Bearer {hash_token(TOKENS['alice'])}"},  # the digest is not the token
])
def test_requests_without_a_valid_token_get_401(server: Server, headers: dict[str, str]) -> None:
    with server.client() as client:
        for path in ("/v1/run", "/v1/call"):
            response = client.post(path, json={"code": "print(1)"}, headers=headers)
            assert response.status_code == 401
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert response.json() == {"detail": "a valid bearer token is required"}


def test_a_token_reaches_only_its_own_tenants_policy(server: Server) -> None:
    code = "import random\nprint(random.random())"
    with server.client("alice") as alice, server.client("bob") as bob:
        as_alice = alice.post("/v1/run", json={"code": code}).json()
        as_bob = bob.post("/v1/run", json={"code": code}).json()
        spin_alice = alice.post("/v1/run", json={"code": "while True: pass"}).json()
        spin_bob = bob.post("/v1/run", json={"code": "while True: pass"}).json()
    assert as_alice["stdout"] != as_bob["stdout"]  # seed 0 vs bob's seed 7
    assert (spin_alice["fuel_used"], spin_bob["fuel_used"]) == (100_000_000, 150_000_000)
    # A request cannot pick a policy: there is no field to name a tenant or a limit.
    with server.client("bob") as bob:
        sneaky = bob.post("/v1/run", json={"code": "pass", "tenant": "alice"})
    assert sneaky.status_code == 422


def test_a_tenants_mounts_are_its_own(server: Server) -> None:
    code = ("text = open('/data/greeting.txt').read()\n"
            "open('/out/shout.txt', 'w').write(text.upper())\nprint(text)")
    with server.client("files") as files, server.client("alice") as alice:
        granted = files.post("/v1/run", json={"code": code})
        denied = alice.post("/v1/run", json={"code": code})
    body = granted.json()
    assert body["ok"] and body["stdout"] == "hello from the host\n", body
    assert [(f["path"], f["size"]) for f in body["files"]] == [("/out/shout.txt", 19)]
    out = Path(server.config_dir) / "out" / "shout.txt"
    assert out.read_text() == "HELLO FROM THE HOST"
    assert server.config_dir not in granted.text  # guest paths only
    assert denied.json()["error"]["type"] == "FileNotFoundError"  # alice has no mounts


def test_a_run_takes_stdin_argv_env_and_the_tenants_python_path(server: Server) -> None:
    code = ("import os, sys, shout\n"
            "print(shout.shout(sys.stdin.read()), sys.argv, dict(os.environ))")
    with server.client("files") as files:
        response = files.post("/v1/run", json={
            "code": code, "stdin": "piped", "argv": ["main.py", "-v"], "env": {"MODE": "x"}})
        called = files.post("/v1/call", json={
            "code": "import os, sys\ndef f():\n    return [sys.stdin.read(), os.environ['A']]",
            "entry": "f", "stdin": "in", "env": {"A": "b"}})
        refused = files.post("/v1/run", json={"code": "pass", "env": {"A=B": "x"}})
    body = response.json()
    assert body["ok"], body
    assert body["stdout"] == "PIPED ['main.py', '-v'] {'MODE': 'x'}\n"
    assert called.json()["value"] == ["in", "b"]
    assert refused.status_code == 422 and "env names" in refused.json()["detail"]


def test_a_tenants_functions_and_http_are_its_own(server: Server) -> None:
    code = "import host\ndef f(n):\n    return host.factorial(n)"
    fetch = ("import urllib.request\n"
             "urllib.request.urlopen('http://169.254.169.254/latest/meta-data/')")
    with server.client("files") as files, server.client("alice") as alice:
        granted = files.post("/v1/call", json={"code": code, "entry": "f", "args": [6]})
        refused = alice.post("/v1/call", json={"code": code, "entry": "f", "args": [6]})
        denied = files.post("/v1/run", json={"code": fetch}).json()
    assert granted.json()["value"] == 720
    assert refused.json()["error"]["type"] in ("CapabilityDenied", "AttributeError")
    assert denied["error"]["type"] == "CapabilityDenied"
    # The decision is reported, but not its reason (which could reveal internal addresses).
    assert [(e["capability"], e["allowed"], e["reason"]) for e in denied["capability_log"]] == [
        ("http", False, None)]


def test_rate_limit_answers_429_per_tenant(server: Server) -> None:
    with server.client("metered") as metered, server.client("alice") as alice:
        statuses = [metered.post("/v1/run", json={"code": "pass"}).status_code
                    for _ in range(3)]
        limited = metered.post("/v1/run", json={"code": "pass"})
        assert alice.post("/v1/run", json={"code": "pass"}).status_code == 200
    assert statuses == [200, 200, 429]
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1


def test_a_full_tenant_queue_answers_429(server: Server) -> None:
    with server.client("narrow") as narrow, server.client("alice") as alice:
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(narrow.post(
            "/v1/run", json={"code": "import time\ntime.sleep(2)\nprint('slept')"})))
        worker.start()
        deadline = time.monotonic() + 60
        while 'wasibox_active_runs{tenant="narrow"} 1.0' not in alice.get("/metrics").text:
            assert time.monotonic() < deadline and worker.is_alive(), "the slow run never began"
            time.sleep(0.01)
        busy = narrow.post("/v1/run", json={"code": "pass"})
        others = alice.post("/v1/run", json={"code": "pass"})
        worker.join()
    assert busy.status_code == 429 and "retry" in busy.json()["detail"]
    assert others.status_code == 200  # another tenant's queue is its own
    assert done[0].status_code == 200 and done[0].json()["stdout"] == "slept\n"


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(50)"])
def test_a_client_that_goes_away_cancels_its_run(server: Server, code: str) -> None:
    before = sum(1 for line in server.run_logs()
                 if line["tenant"] == "patient" and line["limit"] == "cancelled")
    with server.client("patient") as patient:
        with pytest.raises(httpx.ReadTimeout):
            patient.post("/v1/run", json={"code": code}, timeout=1.0)
    # The guest is stopped and its slot freed, long before its 60 s limit.
    with server.client() as client:
        deadline = time.monotonic() + 30
        while 'wasibox_active_runs{tenant="patient"} 0.0' not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the abandoned run still holds its slot"
            time.sleep(0.02)

    def cancelled_runs() -> int:
        return sum(1 for line in server.run_logs()
                   if line["tenant"] == "patient" and line["limit"] == "cancelled")

    deadline = time.monotonic() + 30
    while cancelled_runs() < before + 1:
        assert time.monotonic() < deadline, "no log line says the run was cancelled"
        time.sleep(0.02)
    with server.client("patient") as patient:
        assert patient.post("/v1/run", json={"code": "print('next')"}).json()["stdout"] == "next\n"


# -- request hygiene --------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, needle", [
    ("/v1/run", b'{"code": ', "not valid JSON"),
    ("/v1/run", b"[1, 2]", "body"),
    ("/v1/run", b"{}", "body.code: Field required"),
    ("/v1/run", b'{"code": 5}', "body.code: Input should be a valid string"),
    ("/v1/run", b'{"code": "pass", "limits": {"fule": 1}}', "body.limits.fule: Extra inputs"),
    ("/v1/run", b'{"code": "pass", "limits": {"fuel": 0}}', "body.limits.fuel"),
    ("/v1/call", b'{"code": "pass"}', "body.entry: Field required"),
    ("/v1/call", b'{"code": "pass", "entry": "os.system"}', "body.entry"),
    ("/v1/call", b'{"code": "pass", "entry": "f", "args": {"a": 1}}', "body.args"),
    ("/v1/call", b'{"code": "pass", "entry": "f", "args": ' + b"[" * 20_000 + b"]" * 20_000
     + b"}", "nested too deeply"),
    ("/v1/call", b'{"code": "def f(x): pass", "entry": "f", "args": [' + b"9" * 40 + b"]}",
     "msgpack"),
])
def test_malformed_bodies_get_422_with_a_clear_message(
        alice: httpx.Client, path: str, body: bytes, needle: str) -> None:
    response = alice.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert needle in response.json()["detail"]
    assert len(response.content) < 2000  # the input is not echoed back
    assert_no_host_detail(response.text)


def test_code_over_the_tenants_source_limit_is_422(alice: httpx.Client) -> None:
    response = alice.post("/v1/run", json={"code": "#" * 9000})
    assert response.status_code == 422
    assert "source_bytes" in response.json()["detail"]


def test_a_body_that_is_not_json_gets_415(alice: httpx.Client) -> None:
    response = alice.post("/v1/run", content=b"code=print(1)",
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415


def test_oversized_bodies_get_413(server: Server, alice: httpx.Client) -> None:
    big = {"code": "#" * (MAX_BODY + 1)}
    declared = alice.post("/v1/run", json=big)
    assert declared.status_code == 413
    assert str(MAX_BODY) in declared.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap applies as it streams
        yield b'{"code": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"#" * 1024
        yield b'"}'

    streamed = alice.post("/v1/run", content=chunks(),
                          headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    # Unauthenticated callers are refused before their body is considered.
    with server.client() as anonymous:
        assert anonymous.post("/v1/run", json=big).status_code == 401


def test_one_structured_log_line_per_run(server: Server) -> None:
    before = len(server.run_logs())
    with server.client("bob") as bob:
        bob.post("/v1/run", json={"code": "print('logged')"})
        bob.post("/v1/run", json={"code": "while True: pass"})
    deadline = time.monotonic() + 30
    while len(server.run_logs()) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = [line for line in server.run_logs()[before:] if line["tenant"] == "bob"]
    assert [(line["outcome"], line["limit"]) for line in lines] == [("ok", None),
                                                                   ("limit", "fuel")]
    assert lines[1]["fuel"] == 150_000_000
    assert all(isinstance(line["duration_s"], float) and line["op"] == "run" for line in lines)


def assert_no_host_detail(text: str) -> None:
    for secret in (os.getcwd(), sys.prefix, str(Path.home()), "Traceback (most recent call last)"
                   if "wasibox" in text else "\0"):
        assert secret not in text


def test_a_request_may_lower_the_tenants_limits(alice: httpx.Client) -> None:
    body = alice.post("/v1/run", json={"code": "while True: pass",
                                       "limits": {"fuel": 1_000_000}}).json()
    assert (body["limit_exceeded"], body["fuel_used"]) == ("fuel", 1_000_000)
    body = alice.post("/v1/call", json={"code": "def f():\n    while True: pass", "entry": "f",
                                        "limits": {"fuel": 2_000_000}}).json()
    assert (body["limit_exceeded"], body["fuel_used"]) == ("fuel", 2_000_000)
    body = alice.post("/v1/run", json={"code": "import time\ntime.sleep(30)",
                                       "limits": {"timeout_s": 0.5}}).json()
    assert body["limit_exceeded"] == "timeout"
    body = alice.post("/v1/run", json={"code": "print(len(bytearray(40 * 2**20)))",
                                       "limits": {"memory_bytes": "48MiB"}}).json()
    assert body["limit_exceeded"] == "memory"
    # The narrowing was for those requests only: the tenant's own limits still apply.
    body = alice.post("/v1/run", json={"code": "print(len(bytearray(40 * 2**20)))"}).json()
    assert (body["ok"], body["stdout"]) == (True, f"{40 * 2**20}\n")


@pytest.mark.parametrize(("limits", "needle"), [
    ({"fuel": 100_000_001}, "fuel=100000001 is above this sandbox's limit of 100000000"),
    ({"timeout_s": 6}, "timeout_s=6.0 is above this sandbox's limit of 5.0"),
    ({"source_bytes": "1MiB"}, "source_bytes=1048576 is above"),
])
def test_a_request_cannot_raise_the_tenants_limits(
        alice: httpx.Client, limits: dict[str, object], needle: str) -> None:
    for path, extra in (("/v1/run", {}), ("/v1/call", {"entry": "f"})):
        response = alice.post(path, json={"code": "def f(): pass", "limits": limits, **extra})
        assert response.status_code == 422, response.text
        assert needle in response.json()["detail"]
        assert "never raise them" in response.json()["detail"]


# -- the command ------------------------------------------------------------------------------

def test_serve_refuses_a_bad_config_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f'[tenants.carol]\ntoken_sha256 = "{hash_token("t")}"\n'
                      '[tenants.carol.limits]\nfule = 5\n')
    result = subprocess.run([PYTHON, "-m", "wasibox", "serve", "--config", str(config)],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 2
    assert "tenants.carol.limits.fule: unknown key" in result.stderr


def test_serve_refuses_a_tenant_without_a_token(tmp_path: Path) -> None:
    # A token is optional in the file (a stdio MCP server needs none), never for serve.
    config = tmp_path / "tokenless.toml"
    config.write_text("[tenants.carol]\nlimits = { timeout_s = 1 }\n")
    result = subprocess.run([PYTHON, "-m", "wasibox", "serve", "--config", str(config),
                             "--port", "0"],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 2
    assert "tenants.carol.token_sha256: wasibox serve needs it" in result.stderr


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                    reason="QEMU (qemu-system-x86_64) is not installed, so no run can need "
                           "the microVM's memory")
def test_serve_warns_of_a_memory_limit_the_microvm_cannot_meet(tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(f'[tenants.carol]\ntoken_sha256 = "{hash_token("t")}"\n'
                      'limits = { memory_bytes = "128MiB" }\n')
    live = Server(config)
    live.stop()
    logged = "".join(live.lines)
    assert "wasibox serve: warning: tenants.carol.limits.memory_bytes is 128 MiB, below the " \
        "microVM's minimum of 192 MiB" in logged
