"""The service configuration file (TOML), parsed and validated with pydantic.

One file format serves every wasibox service (``wasibox serve``, and the MCP server). It is
untrusted input in the sense that a typo must never widen a policy: every table forbids
unknown keys, and every error names the key it is about (``tenants.alice.limits.fuel: ...``).

Example::

    [server]
    max_body_bytes = "1MiB"          # requests with larger bodies get 413

    [tenants.alice]
    # sha256 of the bearer token, in hex: `printf %s "$TOKEN" | sha256sum`
    token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    max_concurrency = 4              # runs executing at once for this tenant
    max_queue = 16                   # more wait; beyond that, 429
    rate_limit = { per_second = 20, burst = 40 }
    limits = { fuel = 1_000_000_000, memory_bytes = "256MiB", timeout_s = 2 }
    functions = { lookup = "myapp.sandbox_functions:lookup" }
    backend = "auto"                 # or "wasm", "microvm"; and allow_emulation = true|false
    python_path = ["/data/lib"]      # guest directories first on sys.path
    packages = ["attrs"]             # pure-Python wheels, built into the tenant's guest
    sessions = { max_sessions = 4, idle_timeout_s = 600 }   # live interpreters (/v1/sessions)

    [[tenants.alice.mounts]]
    host = "data"                    # relative to the directory of this file
    guest = "/data"

    [tenants.alice.http]
    allow = ["api.example.com"]
    allow_loopback_endpoints = ["127.0.0.1:8080"]   # exact loopback services, opt-in only

Tokens are stored only as SHA-256 digests: tokens are meant to be long random strings (a
password-hashing function buys nothing for those), and a leaked config file then leaks no
credential.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from .._errors import ConfigError, UsageError
from .._limits import Limits, parse_size
from .._session import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_AGE_S
from ..capabilities.files.mount import Mount
from ..capabilities.http import HttpPolicy

__all__ = [
    "Config",
    "HttpConfig",
    "LimitsConfig",
    "MountConfig",
    "RateLimitConfig",
    "ServerConfig",
    "SessionsConfig",
    "TenantConfig",
    "hash_token",
    "load_config",
    "parse_config",
]

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FUNCTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def hash_token(token: str) -> str:
    """The digest stored in the config for a bearer token (hex SHA-256 of its UTF-8)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _size(value: Any) -> int:
    try:
        return parse_size(value, "the value")
    except UsageError as exc:
        raise ValueError(str(exc)) from None


def _function_name(name: str) -> str:
    if not _FUNCTION_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid function name (a Python identifier)")
    return name


def _import_path(path: str) -> str:
    if not _IMPORT_PATH.match(path):
        raise ValueError(f"{path!r} is not an import path such as 'package.module:function'")
    return path


Size = Annotated[int, pydantic.BeforeValidator(_size)]
FunctionName = Annotated[str, pydantic.AfterValidator(_function_name)]
ImportPath = Annotated[str, pydantic.AfterValidator(_import_path)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Per-run limits; omitted keys keep wasibox's defaults (see ``wasibox.Limits``)."""

    fuel: int | None = Field(default=None, gt=0)
    memory_bytes: Size | None = None
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    output_bytes: Size | None = None
    source_bytes: Size | None = None
    open_files: int | None = Field(default=None, gt=0)
    host_calls: int | None = Field(default=None, gt=0)
    host_call_bytes: Size | None = None
    host_total_bytes: Size | None = None

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump(exclude_none=True))


class RateLimitConfig(_Strict):
    """A token bucket per tenant: ``per_second`` sustained, bursts of up to ``burst``."""

    per_second: float = Field(gt=0, allow_inf_nan=False)
    burst: int = Field(default=1, ge=1)


class MountConfig(_Strict):
    """A host directory the tenant's guests see (read-only unless ``writable``).

    ``host`` is resolved against the config file's directory and must exist.
    """

    host: Path
    guest: str = Field(pattern=r"^/[^\x00]*$")
    writable: bool = False
    quota_bytes: Size | None = None
    quota_files: int | None = Field(default=None, gt=0)
    c_access: bool = False

    @pydantic.field_validator("host", mode="after")
    @classmethod
    def _existing_directory(cls, host: Path, info: pydantic.ValidationInfo) -> Path:
        base = (info.context or {}).get("base_dir")
        if base is not None and not host.is_absolute():
            host = Path(base) / host
        if not host.is_dir():
            raise ValueError("is not an existing directory")
        return host.resolve()

    @pydantic.model_validator(mode="after")
    def _valid_mount(self) -> MountConfig:
        self.to_mount()
        return self

    def to_mount(self) -> Mount:
        """The ``wasibox.Mount`` this describes. Raises ValueError (for pydantic) if invalid."""
        quotas: dict[str, int] = {}
        if self.quota_bytes is not None:
            quotas["quota_bytes"] = self.quota_bytes
        if self.quota_files is not None:
            quotas["quota_files"] = self.quota_files
        try:
            return Mount(self.host, self.guest, writable=self.writable,
                         c_access=self.c_access, **quotas)
        except UsageError as exc:
            raise ValueError(str(exc)) from None


class HttpConfig(_Strict):
    """Mediated HTTP for the tenant's guests: deny by default, allow these host[:port]s.

    ``allow_loopback_endpoints`` opts in exact services on the host's own loopback
    interface (``"127.0.0.1:8080"``, ``"[::1]:8080"``, ``"localhost:8080"``), which are
    otherwise denied like every internal address; no ranges, no wildcards, the port is
    required.
    """

    # Declared before `allow`, so that `allow`'s validator can see it.
    allow_loopback_endpoints: list[Annotated[str, Field(min_length=1, max_length=300)]] = []
    allow: list[Annotated[str, Field(min_length=1, max_length=300)]] = Field(
        default=[], validate_default=True)
    methods: list[Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]] = ["GET", "HEAD"]
    max_response_bytes: Size = 10 * 2**20
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    max_redirects: int = Field(default=3, ge=0, le=20)
    max_header_count: int = Field(default=100, gt=0)
    max_header_bytes: Size = 64 * 2**10

    @pydantic.field_validator("allow", mode="after")
    @classmethod
    def _something_allowed(cls, allow: list[str], info: pydantic.ValidationInfo) -> list[str]:
        if not allow and not info.data.get("allow_loopback_endpoints"):
            raise ValueError("list at least one host to allow (or an allow_loopback_endpoints "
                             "entry); omit the http table to deny all network access")
        return allow

    @pydantic.model_validator(mode="after")
    def _valid_policy(self) -> HttpConfig:
        self.to_policy()
        return self

    def to_policy(self) -> HttpPolicy:
        """The ``wasibox.HttpPolicy`` this describes. Raises ValueError (for pydantic)."""
        try:
            return HttpPolicy(allow=self.allow, methods=self.methods,
                              max_response_bytes=self.max_response_bytes,
                              timeout_s=self.timeout_s, max_redirects=self.max_redirects,
                              max_header_count=self.max_header_count,
                              max_header_bytes=self.max_header_bytes,
                              allow_loopback_endpoints=self.allow_loopback_endpoints)
        except UsageError as exc:
            raise ValueError(str(exc)) from None


class SessionsConfig(_Strict):
    """Live sessions (``wasibox.Session``): ``/v1/sessions`` in ``wasibox serve``, and the
    interpreter that ``run_python`` keeps from call to call in ``wasibox mcp``."""

    enabled: bool = Field(
        default=True,
        description="Whether this tenant may keep sessions. On: `run_python` in `wasibox "
                    "mcp` keeps its variables from one call to the next (a `reset` tool "
                    "starts afresh), and `wasibox serve` offers `/v1/sessions`. Off: every "
                    "run starts from the snapshot.")
    idle_timeout_s: float = Field(
        default=DEFAULT_IDLE_TIMEOUT_S, gt=0, allow_inf_nan=False,
        description="A session with no call for this long ends and frees its guest.")
    max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S, gt=0, allow_inf_nan=False,
        description="A session ends this long after it opened, however busy.")
    max_sessions: int = Field(
        default=4, ge=1, le=1000,
        description="Sessions this tenant may hold open at once (each keeps a guest, up to "
                    "`limits.memory_bytes`, alive); past it, `wasibox serve` answers 429.")


class TenantConfig(_Strict):
    """One tenant: its credential, its policy and its share of the service.

    ``token_sha256`` is required by ``wasibox serve`` (and by nothing else: a stdio MCP
    server is reached only by the process that started it).
    """

    token_sha256: str | None = Field(default=None,
                                     description="hex SHA-256 of the tenant's bearer token")
    limits: LimitsConfig = LimitsConfig()
    max_concurrency: int = Field(default=2, ge=1, le=256)
    max_queue: int = Field(default=16, ge=0, le=10_000)
    rate_limit: RateLimitConfig | None = None
    seed: int = 0
    clock: Literal["virtual", "real"] = "virtual"
    entropy: Literal["seeded", "real"] = "seeded"
    mounts: list[MountConfig] = []
    http: HttpConfig | None = None
    #: Host functions the guest may call, by name: "package.module:attribute".
    functions: dict[FunctionName, ImportPath] = {}
    #: Where runs execute: "auto" picks the microVM only for code that needs it (numpy...).
    backend: Literal["auto", "wasm", "microvm"] = "auto"
    #: Let the microVM run under QEMU's software emulation (TCG), which is not a security
    #: boundary; unset, the WASIBOX_ALLOW_EMULATION environment variable decides.
    allow_emulation: bool | None = None
    #: Guest directories (inside the mounts) put first on the guest's sys.path, so runs
    #: import the modules and packages there: ["/src"].
    python_path: list[Annotated[str, Field(pattern=r"^/[^\x00]*$")]] = []
    #: Third-party pure-Python packages for the guest, as pip requirements: ["attrs",
    #: "pyyaml==6.0.2"]. Resolved with pip (wheels only) and built into the tenant's guest
    #: when the service starts (a minute or two, once per package set).
    packages: list[str] = []
    #: Where pip finds the packages: local wheel directories (relative to this file)...
    package_find_links: list[Path] = []
    #: ...a package index instead of pip's configured one...
    package_index_url: str | None = None
    #: ...and whether to use only package_find_links.
    package_no_index: bool = False
    sessions: SessionsConfig = SessionsConfig()

    @pydantic.field_validator("token_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256_HEX.match(value):
            raise ValueError("must be 64 lowercase hex digits (the SHA-256 of the token)")
        return value

    @pydantic.field_validator("package_find_links", mode="after")
    @classmethod
    def _wheelhouses(cls, links: list[Path], info: pydantic.ValidationInfo) -> list[Path]:
        base = (info.context or {}).get("base_dir")
        return [Path(base) / link if base is not None and not link.is_absolute() else link
                for link in links]

    @pydantic.model_validator(mode="after")
    def _valid_packages(self) -> TenantConfig:
        self.sandbox_options()
        return self

    def sandbox_options(self) -> dict[str, Any]:
        """The Sandbox options for the tenant's programs: ``python_path`` and ``packages``.

        Raises ValueError (for pydantic) for a requirement Packages refuses.
        """
        options: dict[str, Any] = {"python_path": list(self.python_path)}
        if self.packages:
            from .._packages import Packages

            try:
                options["packages"] = Packages(
                    requirements=tuple(self.packages), index_url=self.package_index_url,
                    find_links=tuple(str(link) for link in self.package_find_links),
                    no_index=self.package_no_index)
            except UsageError as exc:
                raise ValueError(str(exc)) from None
        elif self.package_find_links or self.package_index_url or self.package_no_index:
            raise ValueError("package_find_links, package_index_url and package_no_index "
                             "say where to find packages: list the packages in packages")
        return options

    @pydantic.field_validator("limits", mode="after")
    @classmethod
    def _valid_limits(cls, value: LimitsConfig) -> LimitsConfig:
        try:
            value.to_limits()
        except UsageError as exc:
            raise ValueError(str(exc)) from None
        return value

    @pydantic.model_validator(mode="after")
    def _vm_memory(self) -> TenantConfig:
        # A tenant that runs only in the microVM with less memory than a VM needs could
        # never run anything: refuse the file rather than fail every run.
        from ..backends.microvm.runtime import MIN_MEMORY_BYTES

        memory = self.limits.to_limits().memory_bytes
        if self.backend == "microvm" and memory < MIN_MEMORY_BYTES:
            raise ValueError(
                f"limits.memory_bytes is {memory // 2**20} MiB, below the microVM's minimum of "
                f"{MIN_MEMORY_BYTES // 2**20} MiB, so no run could start: raise it to at least "
                f'"{MIN_MEMORY_BYTES // 2**20}MiB"')
        return self

    def warnings(self, tenant: str) -> list[str]:
        """What the operator should know at start-up: a policy that defeats part of itself
        on this machine (the file is valid, so these do not refuse it)."""
        from ..backends.microvm.runtime import MIN_MEMORY_BYTES, microvm_available

        memory = self.limits.to_limits().memory_bytes
        if self.backend == "auto" and memory < MIN_MEMORY_BYTES and microvm_available():
            return [f"tenants.{tenant}.limits.memory_bytes is {memory // 2**20} MiB, below the "
                    f"microVM's minimum of {MIN_MEMORY_BYTES // 2**20} MiB: code that needs the "
                    "microVM (numpy, pandas, ...) will fail; raise it to at least "
                    f'"{MIN_MEMORY_BYTES // 2**20}MiB", or set backend = "wasm" to keep every '
                    "run in WebAssembly"]
        return []

    def resolve_functions(self, tenant: str) -> dict[str, Callable[..., Any]]:
        """Import each host function. Raises ConfigError naming the key that fails."""
        resolved: dict[str, Callable[..., Any]] = {}
        for name, path in self.functions.items():
            key = f"tenants.{tenant}.functions.{name}"
            module_name, _, attribute = path.partition(":")
            try:
                target: Any = importlib.import_module(module_name)
                for part in attribute.split("."):
                    target = getattr(target, part)
            except Exception as exc:  # noqa: BLE001 - any import failure is a config error
                raise ConfigError(f"{key}: cannot import {path!r} "
                                  f"({type(exc).__name__}: {exc})") from None
            if not callable(target):
                raise ConfigError(f"{key}: {path!r} is not callable")
            resolved[name] = target
        return resolved


class ServerConfig(_Strict):
    """Settings of the HTTP service itself."""

    max_body_bytes: Size = 2**20


class Config(_Strict):
    """A whole configuration file: the server's settings and at least one tenant."""

    server: ServerConfig = ServerConfig()
    tenants: dict[str, TenantConfig] = Field(min_length=1)

    @pydantic.field_validator("tenants")
    @classmethod
    def _distinct_tenants(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        seen: dict[str, str] = {}
        for name, tenant in tenants.items():
            if not _TENANT_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid tenant name (letters, digits, "
                                 "'_', '.', '-'; at most 64)")
            if tenant.token_sha256 is None:
                continue
            if tenant.token_sha256 in seen:
                raise ValueError(f"tenants {seen[tenant.token_sha256]!r} and {name!r} have the "
                                 "same token_sha256; every tenant needs its own token")
            seen[tenant.token_sha256] = name
        return tenants


def parse_config(data: dict[str, Any], *, base_dir: str | os.PathLike[str] | None = None,
                 source: str = "the configuration") -> Config:
    """Validate already-parsed TOML data. Raises ConfigError naming every bad key."""
    try:
        return Config.model_validate(data, context={"base_dir": base_dir})
    except pydantic.ValidationError as exc:
        problems = [f"  {_location(error['loc'])}: {_message(error)}" for error in exc.errors()]
        raise ConfigError(f"{source} is not valid:\n" + "\n".join(problems)) from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML configuration file.

    Relative mount paths are taken from the file's directory. Raises ConfigError for a file
    that cannot be read, is not TOML, or does not validate (naming each bad key).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_config(data, base_dir=path.parent, source=str(path))


def _location(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif parts:
            parts.append(f".{part}")
        else:
            parts.append(str(part))
    return "".join(parts) or "(top level)"


def _message(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key (check its spelling; unknown keys are refused)"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")
