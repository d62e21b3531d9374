"""The service configuration file: validated with pydantic, every error naming its key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

import wasibox
from wasibox.services.config import hash_token, load_config, parse_config
from wasibox.services.serve import make_sandbox

DIGEST = hash_token("token")


def tenant(**fields: Any) -> dict[str, Any]:
    return {"tenants": {"alice": {"token_sha256": DIGEST, **fields}}}


def problems(data: dict[str, Any]) -> str:
    with pytest.raises(wasibox.ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_a_full_config_parses_and_normalises(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    path = tmp_path / "wasibox.toml"
    path.write_text(f"""
[server]
max_body_bytes = "2MiB"

[tenants.alice]
token_sha256 = "{DIGEST}"
max_concurrency = 3
max_queue = 5
rate_limit = {{ per_second = 2.5, burst = 4 }}
limits = {{ fuel = 1_000_000, memory_bytes = "64MiB", timeout_s = 2 }}
functions = {{ dumps = "json:dumps" }}

[[tenants.alice.mounts]]
host = "data"
guest = "/data"

[tenants.alice.http]
allow = ["api.example.com", "*.example.org:8443"]
methods = ["GET"]
""")
    config = load_config(path)
    alice = config.tenants["alice"]
    assert config.server.max_body_bytes == 2 * 2**20
    assert alice.limits.to_limits() == wasibox.Limits(fuel=1_000_000, memory_bytes="64MiB",
                                                      timeout_s=2)
    assert (alice.max_concurrency, alice.max_queue, alice.rate_limit.burst) == (3, 5, 4)
    assert alice.mounts[0].host == (tmp_path / "data").resolve()  # relative to the file
    assert alice.mounts[0].writable is False
    assert alice.http is not None and alice.http.allow[1] == "*.example.org:8443"
    import json
    assert alice.resolve_functions("alice") == {"dumps": json.dumps}


def test_hash_token_is_hex_sha256() -> None:
    assert hash_token("abc") == hashlib.sha256(b"abc").hexdigest()


@pytest.mark.parametrize("data, expected", [
    (tenant(limits={"fule": 5}), "tenants.alice.limits.fule: unknown key"),
    (tenant(limits={"fuel": 0}), "tenants.alice.limits.fuel: Input should be greater than 0"),
    (tenant(limits={"memory_bytes": "lots"}), "tenants.alice.limits.memory_bytes"),
    (tenant(limits={"timeout_s": float("inf")}), "tenants.alice.limits.timeout_s"),
    (tenant(rate_limit={"per_second": 0}), "tenants.alice.rate_limit.per_second"),
    (tenant(max_queue=-1), "tenants.alice.max_queue"),
    (tenant(clock="sundial"), "tenants.alice.clock"),
    (tenant(mounts=[{"host": "/definitely/not/here", "guest": "/d"}]),
     "tenants.alice.mounts[0].host: is not an existing directory"),
    (tenant(mounts=[{"host": ".", "guest": "relative"}]), "tenants.alice.mounts[0].guest"),
    (tenant(mounts=[{"host": ".", "guest": "/"}]), "tenants.alice.mounts[0]: Mount guest_path"),
    (tenant(mounts=[{"host": ".", "guest": "/d", "quota_files": 0}]),
     "tenants.alice.mounts[0].quota_files"),
    (tenant(http={"allow": []}), "tenants.alice.http.allow"),
    (tenant(http={}), "tenants.alice.http.allow: list at least one host"),
    (tenant(http={"allow_loopback_endpoints": ["127.0.0.0/8"]}),
     "tenants.alice.http: cannot use the HttpPolicy.allow_loopback_endpoints entry"),
    (tenant(http={"allow_loopback_endpoints": ["10.0.0.1:80"]}),
     "tenants.alice.http: cannot use the HttpPolicy.allow_loopback_endpoints entry"),
    (tenant(http={"allow": ["a.com"], "methods": ["BREW"]}), "tenants.alice.http.methods[0]"),
    (tenant(functions={"f": "not a path"}), "tenants.alice.functions.f: 'not a path' is not"),
    (tenant(functions={"1f": "json:dumps"}), "tenants.alice.functions.1f"),
    ({"tenants": {"alice": {"token_sha256": "abc"}}}, "tenants.alice.token_sha256: must be 64"),
    (tenant(backend="docker"), "tenants.alice.backend"),
    (tenant(allow_emulation="yes please"), "tenants.alice.allow_emulation"),
    (tenant(backend="microvm", limits={"memory_bytes": "128MiB"}),
     "tenants.alice: limits.memory_bytes is 128 MiB, below the microVM's minimum of 192 MiB, "
     'so no run could start: raise it to at least "192MiB"'),
    ({"tenants": {}}, "tenants: "),
    ({"tenants": {"a b": {"token_sha256": DIGEST}}}, "'a b' is not a valid tenant name"),
    ({"tenants": {"a": {"token_sha256": DIGEST}, "b": {"token_sha256": DIGEST}}},
     "have the same token_sha256"),
    ({**tenant(), "sever": {}}, "sever: unknown key"),
    ({**tenant(), "server": {"max_body_bytes": 0}}, "server.max_body_bytes"),
])
@pytest.mark.guest
def test_errors_name_the_bad_key(data: dict[str, Any], expected: str) -> None:
    assert expected in problems(data)


def test_a_tenant_needs_no_token_and_chooses_its_backend() -> None:
    # The token is for `wasibox serve` (which refuses a tenant without one:
    # tests/services/test_serve.py); a stdio MCP server needs none.
    config = parse_config({"tenants": {"agent": {"backend": "microvm", "allow_emulation": True,
                                                 "limits": {"memory_bytes": "256MiB"}},
                                       "other": {}}})
    agent, other = config.tenants["agent"], config.tenants["other"]
    assert (agent.token_sha256, agent.backend, agent.allow_emulation) == (None, "microvm", True)
    assert (other.backend, other.allow_emulation) == ("auto", None)


def test_every_problem_is_reported_at_once() -> None:
    message = problems(tenant(limits={"fuel": -1, "output_bytes": "x"}, max_queue=-2))
    assert all(key in message for key in ("limits.fuel", "limits.output_bytes", "max_queue"))


def test_unreadable_and_non_toml_files(tmp_path: Path) -> None:
    with pytest.raises(wasibox.ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[tenants.alice\n")
    with pytest.raises(wasibox.ConfigError, match="not valid TOML"):
        load_config(broken)


def test_host_functions_that_cannot_be_imported_name_their_key() -> None:
    config = parse_config(tenant(functions={"f": "wasibox_no_such_module:f",
                                            "g": "json:no_such_attribute"}))
    with pytest.raises(wasibox.ConfigError, match="tenants.alice.functions.f: cannot import"):
        config.tenants["alice"].resolve_functions("alice")
    config = parse_config(tenant(functions={"v": "wasibox:__version__"}))
    with pytest.raises(wasibox.ConfigError, match="tenants.alice.functions.v: .* not callable"):
        config.tenants["alice"].resolve_functions("alice")


@pytest.mark.guest
def test_a_tenants_sandbox_enforces_its_policy() -> None:
    config = parse_config(tenant(limits={"fuel": 50_000_000}, seed=3, max_concurrency=2,
                                 max_queue=1))
    with make_sandbox("alice", config.tenants["alice"]) as sb:
        assert sb.limits.fuel == 50_000_000 and sb.policy.seed == 3
        assert (sb._runner.max_concurrency, sb._runner.max_queue) == (2, 1)
        assert sb.run("while True: pass").fuel_used == 50_000_000


@pytest.mark.guest
def test_a_tenants_mounts_are_granted(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "numbers.txt").write_text("1 2 3")
    (tmp_path / "out").mkdir()
    config = parse_config(tenant(mounts=[
        {"host": "in", "guest": "/in"},
        {"host": "out", "guest": "/out", "writable": True, "quota_bytes": "1MiB"}]),
        base_dir=tmp_path)
    with make_sandbox("alice", config.tenants["alice"]) as sb:
        result = sb.run("total = sum(map(int, open('/in/numbers.txt').read().split()))\n"
                        "open('/out/total.txt', 'w').write(str(total))\n"
                        "open('/in/numbers.txt', 'w')")
    assert result.error is not None and "Read-only" in result.error.message
    assert not (tmp_path / "out" / "total.txt").exists()  # a failed run publishes nothing
    with make_sandbox("alice", config.tenants["alice"]) as sb:
        result = sb.run("open('/out/total.txt', 'w').write(str(sum(map(int, "
                        "open('/in/numbers.txt').read().split()))))")
    assert result.ok, result
    assert [f.path for f in result.files] == ["/out/total.txt"]
    assert (tmp_path / "out" / "total.txt").read_text() == "6"


def test_conflicting_mounts_name_the_tenant(tmp_path: Path) -> None:
    config = parse_config(tenant(mounts=[{"host": str(tmp_path), "guest": "/d"},
                                         {"host": str(tmp_path), "guest": "/d"}]))
    with pytest.raises(wasibox.ConfigError, match="tenants.alice: "):
        make_sandbox("alice", config.tenants["alice"])


@pytest.mark.guest
def test_a_tenants_host_functions_and_http_are_granted() -> None:
    config = parse_config(tenant(functions={"factorial": "math:factorial"},
                                 http={"allow": ["api.example.com"], "methods": ["GET"]}))
    alice = config.tenants["alice"]
    assert alice.http is not None and alice.http.to_policy().methods == ("GET",)
    with make_sandbox("alice", alice) as sb:
        assert sb.call("import host\ndef f(n):\n    return host.factorial(n)", "f", 5) == 120
        denied = sb.run("import urllib.request\n"
                        "urllib.request.urlopen('http://elsewhere.example.net/')")
    assert denied.error is not None and not denied.ok
    assert [(e.capability, e.allowed) for e in denied.capability_log] == [("http", False)]


def test_an_http_policy_the_sandbox_refuses_names_its_key() -> None:
    message = problems(tenant(http={"allow": ["http://not-a-host-entry/"]}))
    assert "tenants.alice.http: " in message


@pytest.mark.guest
def test_loopback_endpoints_are_an_explicit_opt_in() -> None:
    config = parse_config(tenant(http={"allow_loopback_endpoints": ["127.0.0.1:8080",
                                                                   "[::1]:9000"]}))
    http = config.tenants["alice"].http
    assert http is not None and http.allow == []
    policy = http.to_policy()
    assert policy.allows_loopback_endpoint("127.0.0.1", 8080)
    assert policy.allows_loopback_endpoint("::1", 9000)
    assert not policy.allows_loopback_endpoint("127.0.0.1", 8081)
    assert not policy.allows("http", "127.0.0.1", 8080)  # not added to the allowlist
    default = parse_config(tenant(http={"allow": ["api.example.com"]})).tenants["alice"].http
    assert default is not None and default.to_policy().allow_loopback_endpoints == ()
