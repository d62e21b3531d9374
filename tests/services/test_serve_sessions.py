"""``/v1/sessions`` in ``wasibox serve``: a real service process, a real HTTP client on
loopback."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from wasibox.services.config import hash_token

from .test_serve import TOKENS, Server, serving

pytestmark = pytest.mark.guest

SESSION_TOKENS = {"keeper": "keeper-secret-token", "single": "single-secret-token",
                  "brief": "brief-secret-token", "stateless": "stateless-secret-token"}

CONFIG = f"""
[tenants.keeper]
token_sha256 = "{hash_token(SESSION_TOKENS['keeper'])}"
limits = {{ fuel = 1_000_000_000 }}
sessions = {{ max_sessions = 2 }}

[tenants.single]
token_sha256 = "{hash_token(SESSION_TOKENS['single'])}"
max_concurrency = 1
max_queue = 0
clock = "real"

[tenants.brief]
token_sha256 = "{hash_token(SESSION_TOKENS['brief'])}"
sessions = {{ idle_timeout_s = 0.5 }}

[tenants.stateless]
token_sha256 = "{hash_token(SESSION_TOKENS['stateless'])}"
sessions = {{ enabled = false }}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve-sessions") / "wasibox.toml"
    config.write_text(CONFIG)
    TOKENS.update(SESSION_TOKENS)
    yield from serving(config)


def open_session(client: httpx.Client) -> str:
    response = client.post("/v1/sessions")
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_a_session_lives_from_create_to_delete(server: Server) -> None:
    with server.client("keeper") as client:
        response = client.post("/v1/sessions")
        assert response.status_code == 201
        created = response.json()
        assert created["idle_timeout_s"] == 600 and created["max_age_s"] == 3600
        assert created["memory_bytes"] == 256 * 2**20
        key = created["id"]
        first = client.post(f"/v1/sessions/{key}/run", json={"code": "import json\nx = 41"})
        assert first.status_code == 200 and first.json()["ok"]
        assert first.json()["session_ended"] is None
        second = client.post(f"/v1/sessions/{key}/run",
                             json={"code": "x += 1\nprint(json.dumps(x))"})
        assert second.json()["stdout"] == "42\n"
        assert client.delete(f"/v1/sessions/{key}").status_code == 204
        assert client.post(f"/v1/sessions/{key}/run", json={"code": "pass"}).status_code == 404
        assert client.delete(f"/v1/sessions/{key}").status_code == 404


def test_a_limit_ends_the_session_and_later_calls_get_410(server: Server) -> None:
    with server.client("keeper") as client:
        key = open_session(client)
        stopped = client.post(f"/v1/sessions/{key}/run", json={
            "code": "while True: pass", "limits": {"fuel": 10_000_000}})
        assert stopped.status_code == 200
        assert (stopped.json()["limit_exceeded"], stopped.json()["session_ended"]) == \
            ("fuel", "limit")
        gone = client.post(f"/v1/sessions/{key}/run", json={"code": "pass"})
        assert gone.status_code == 410
        assert gone.json()["reason"] == "limit"
        assert "open a new session" in gone.json()["detail"].lower()
        # A per-call limit above the tenant's is refused, as for /v1/run; so is memory.
        other = open_session(client)
        for limits in ({"fuel": 10**12}, {"memory_bytes": "64MiB"}):
            refused = client.post(f"/v1/sessions/{other}/run",
                                  json={"code": "pass", "limits": limits})
            assert refused.status_code == 422, limits
        assert client.delete(f"/v1/sessions/{other}").status_code == 204
        client.delete(f"/v1/sessions/{key}")


def test_sessions_are_the_tenants_own_and_bounded(server: Server) -> None:
    with server.client("keeper") as keeper, server.client("brief") as other:
        key = open_session(keeper)
        assert keeper.post(f"/v1/sessions/{key}/run", json={"code": "secret = 1"}).json()["ok"]
        # Another tenant cannot reach it by its id.
        assert other.post(f"/v1/sessions/{key}/run", json={"code": "print(secret)"}
                          ).status_code == 404
        assert other.delete(f"/v1/sessions/{key}").status_code == 404
        # Two sessions at most for this tenant; a third is 429 until one is deleted.
        second = open_session(keeper)
        refused = keeper.post("/v1/sessions")
        assert refused.status_code == 429 and "2 open sessions" in refused.json()["detail"]
        # Sessions are isolated from each other.
        leak = keeper.post(f"/v1/sessions/{second}/run", json={"code": "print(secret)"})
        assert leak.json()["error"]["type"] == "NameError"
        assert keeper.delete(f"/v1/sessions/{second}").status_code == 204
        third = open_session(keeper)
        for each in (key, third):
            assert keeper.delete(f"/v1/sessions/{each}").status_code == 204


def test_a_session_call_holds_one_of_the_tenants_slots(server: Server) -> None:
    with server.client("single") as client:
        key = open_session(client)
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(client.post(
            f"/v1/sessions/{key}/run", json={"code": "import time\ntime.sleep(2)\nx = 1"})))
        worker.start()
        deadline = time.monotonic() + 60
        while 'wasibox_active_runs{tenant="single"} 1.0' not in client.get("/metrics").text:
            assert time.monotonic() < deadline and worker.is_alive(), "the call never began"
            time.sleep(0.01)
        busy = client.post("/v1/run", json={"code": "pass"})
        worker.join()
        assert busy.status_code == 429
        assert done[0].status_code == 200 and done[0].json()["ok"]
        # An idle session holds no slot: a run gets through.
        assert client.post("/v1/run", json={"code": "pass"}).status_code == 200
        assert client.post(f"/v1/sessions/{key}/run", json={"code": "print(x)"}
                           ).json()["stdout"] == "1\n"
        client.delete(f"/v1/sessions/{key}")


def test_an_idle_session_expires(server: Server) -> None:
    with server.client("brief") as client:
        key = open_session(client)
        assert client.post(f"/v1/sessions/{key}/run", json={"code": "x = 1"}).json()["ok"]
        time.sleep(1.5)
        gone = client.post(f"/v1/sessions/{key}/run", json={"code": "print(x)"})
        assert gone.status_code == 410 and gone.json()["reason"] == "idle"
        client.delete(f"/v1/sessions/{key}")


def test_sessions_can_be_turned_off_per_tenant(server: Server) -> None:
    with server.client("stateless") as client:
        refused = client.post("/v1/sessions")
        assert refused.status_code == 403
        assert "tenants.stateless.sessions.enabled" in refused.json()["detail"]
        assert client.post("/v1/run", json={"code": "pass"}).status_code == 200


def test_sessions_need_a_token(server: Server) -> None:
    with server.client() as anonymous:
        assert anonymous.post("/v1/sessions").status_code == 401
        assert anonymous.post("/v1/sessions/x/run", json={"code": "pass"}).status_code == 401


def open_sessions(client: httpx.Client, tenant: str) -> float:
    """The ``wasibox_open_sessions`` gauge of ``tenant``, as /metrics reports it."""
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    found = re.findall(rf'^wasibox_open_sessions{{tenant="{tenant}"}} (\S+)$', metrics.text,
                       flags=re.MULTILINE)
    assert len(found) == 1, metrics.text
    return float(found[0])


def test_metrics_count_the_open_sessions_per_tenant(server: Server) -> None:
    with server.client("keeper") as keeper, server.client("brief") as brief:
        before = open_sessions(keeper, "keeper")
        first, second = open_session(keeper), open_session(keeper)
        assert open_sessions(keeper, "keeper") == before + 2
        # A session ended by a limit is no longer open, though its id still answers 410.
        stopped = keeper.post(f"/v1/sessions/{first}/run", json={
            "code": "while True: pass", "limits": {"fuel": 10_000_000}})
        assert stopped.json()["session_ended"] == "limit"
        assert open_sessions(keeper, "keeper") == before + 1
        assert keeper.delete(f"/v1/sessions/{second}").status_code == 204
        assert open_sessions(keeper, "keeper") == before
        keeper.delete(f"/v1/sessions/{first}")
        # One that expires idle stops counting without any request to it.
        idle = open_session(brief)
        assert open_sessions(brief, "brief") == 1
        deadline = time.monotonic() + 30
        while open_sessions(brief, "brief") != 0:
            assert time.monotonic() < deadline, "the idle session never stopped counting"
            time.sleep(0.1)
        assert open_sessions(brief, "stateless") == 0  # sessions off: always none
        brief.delete(f"/v1/sessions/{idle}")
