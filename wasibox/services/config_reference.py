"""The configuration reference (``docs/configuration.md``), generated from the pydantic models.

Every key's TOML path, type, default and constraints are read from the models in
``wasibox/services/config.py``; its meaning is the field's ``description`` when the model has one,
else the entry for it in ``MEANINGS``. ``wasibox config-reference`` prints the result, and a
test compares it with the checked-in file, so the reference cannot drift from the models: a
key without a meaning, or a meaning for a key that no longer exists, is an error here.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .._limits import Limits
from ..capabilities.files.mount import Mount
from .config import Config, LimitsConfig, MountConfig

__all__ = ["MEANINGS", "config_reference"]

#: What each key means, by TOML path (``NAME`` stands for a tenant's name).
MEANINGS = {
    "server.max_body_bytes": "Largest request body `wasibox serve` reads; larger ones get 413.",
    "tenants.NAME.sessions": "Live sessions, whose state persists across calls (the table "
                             "below).",
    "tenants.NAME.limits": "Per-run limits of this tenant's runs (the table below).",
    "tenants.NAME.backend": "Where runs execute: `auto` takes the microVM only for code that "
                            "needs it (numpy, pandas), `wasm` never, `microvm` always.",
    "tenants.NAME.allow_emulation": "Let the microVM run under QEMU's software emulation "
                                    "(TCG), which is not a security boundary; unset, the "
                                    "`WASIBOX_ALLOW_EMULATION` environment variable decides.",
    "tenants.NAME.max_concurrency": "Runs of this tenant executing at once.",
    "tenants.NAME.max_queue": "Runs that may wait for a free slot; beyond that, 429 (`Busy`).",
    "tenants.NAME.rate_limit": "A token bucket on this tenant's requests (the table below); "
                               "unset: no rate limit.",
    "tenants.NAME.seed": "Seed of the guest's `random` module and seeded entropy.",
    "tenants.NAME.clock": "`virtual` (deterministic, starts at 2024-01-01) or the host's "
                          "`real` clock.",
    "tenants.NAME.entropy": "`seeded` (deterministic, from `seed`) or the host's `real` "
                            "OS entropy.",
    "tenants.NAME.mounts": "Host directories this tenant's guests see (the table below); "
                           "none by default.",
    "tenants.NAME.http": "Mediated HTTP (the table below); unset: no network access.",
    "tenants.NAME.functions": "Host functions the guest may call (`import host`), by name: "
                              "`name = \"package.module:function\"`.",
    "tenants.NAME.python_path": "Guest directories (inside the mounts) put first on the "
                                "guest's `sys.path`, so runs import the modules there: "
                                "`[\"/src\"]`.",
    "tenants.NAME.packages": "Third-party pure-Python packages for the guest, as pip "
                             "requirements (`[\"attrs\", \"pyyaml==6.0.2\"]`): resolved with "
                             "pip (wheels only) and built into the tenant's guest when the "
                             "service starts, once per package set.",
    "tenants.NAME.package_find_links": "Local wheel directories pip also searches for "
                                       "`packages`, relative to the config file's directory.",
    "tenants.NAME.package_index_url": "The package index for `packages` instead of pip's "
                                      "configured one.",
    "tenants.NAME.package_no_index": "Take `packages` from `package_find_links` only.",
    "tenants.NAME.limits.fuel": "CPU budget in fuel units (deterministic); unset, "
                                "`ceil(timeout_s * 1e11)`, enough for the whole timeout.",
    "tenants.NAME.limits.memory_bytes": "Cap on the guest's memory; past it, `MemoryError`.",
    "tenants.NAME.limits.timeout_s": "Wall-clock budget of a run, in seconds.",
    "tenants.NAME.limits.output_bytes": "Cap on stdout and stderr together.",
    "tenants.NAME.limits.source_bytes": "Cap on the size of submitted code.",
    "tenants.NAME.limits.open_files": "Files a run may hold open on its mounts "
                                      "(past it, `EMFILE`).",
    "tenants.NAME.limits.host_calls": "Calls to host functions and HTTP in one run.",
    "tenants.NAME.limits.host_call_bytes": "Cap on one host call's payload, each way.",
    "tenants.NAME.limits.host_total_bytes": "Cap on all host calls' payloads in one run.",
    "tenants.NAME.rate_limit.per_second": "Requests per second, sustained.",
    "tenants.NAME.rate_limit.burst": "Requests allowed at once above the sustained rate.",
    "tenants.NAME.mounts.host": "The host directory, relative to the config file's "
                                "directory; it must exist.",
    "tenants.NAME.mounts.guest": "Where the guest sees it: an absolute path such as `/data`.",
    "tenants.NAME.mounts.writable": "Whether runs may change it; changes are published only "
                                    "when a run ends ok.",
    "tenants.NAME.mounts.quota_bytes": "Byte quota of a writable mount (past it, `ENOSPC`).",
    "tenants.NAME.mounts.c_access": "Show a writable mount to C code in the guest too "
                                    "(`sqlite3` databases): its staging holds private copies "
                                    "of its files, and its runs get a new instance.",
    "tenants.NAME.mounts.quota_files": "Files and directories a writable mount may hold "
                                       "(past it, `EDQUOT`).",
    "tenants.NAME.http.allow_loopback_endpoints": "Exact services on the host's loopback "
                                                  "interface (`\"127.0.0.1:8080\"`), otherwise "
                                                  "denied like every internal address.",
    "tenants.NAME.http.allow": "Hosts (`host` or `host:port`, `*.example.com`) the guest may "
                               "reach.",
    "tenants.NAME.http.methods": "HTTP methods the guest may use.",
    "tenants.NAME.http.max_response_bytes": "Cap on a decoded response body.",
    "tenants.NAME.http.timeout_s": "Timeout of one request, in seconds.",
    "tenants.NAME.http.max_redirects": "Redirects followed, each checked against the policy.",
    "tenants.NAME.http.max_header_count": "Cap on the number of response headers.",
    "tenants.NAME.http.max_header_bytes": "Cap on the response headers' total size.",
}

_HEADER = """\
# Configuration reference

<!-- Generated by `wasibox config-reference` from the models in wasibox/services/config.py;
     do not edit: a test fails when this file differs from what the models say. -->

`wasibox serve --config FILE` and `wasibox mcp --config FILE` read one TOML file. Every table
forbids keys it does not list here, so a typo is an error that names the key
(`tenants.alice.limits.fuel: ...`), never a silently wider policy. Sizes take an integer
number of bytes or a string with a unit (`"64MiB"`, `"10MB"`, `"512KiB"`). A key whose default
is *unset* may be left out.
"""

#: Where an unset key's value comes from.
_APPLIES: dict[type[BaseModel], type[Any]] = {LimitsConfig: Limits, MountConfig: Mount}
_SCALARS = {int: "integer", float: "float", str: "string", bool: "boolean", Path: "path"}
_VALIDATOR_TYPES = {"_size": "size", "_import_path": "import path",
                    "_function_name": "identifier"}


def config_reference() -> str:
    """The Markdown reference of every configuration key.

    Raises LookupError naming a key that has no meaning, or a meaning whose key is gone.
    """
    sections: list[str] = []
    used: set[str] = set()
    _describe(Config, "", False, sections, used)
    stale = sorted(set(MEANINGS) - used)
    if stale:
        raise LookupError(f"MEANINGS describes keys the models no longer have: {stale}")
    return _HEADER + "".join(sections)


def _describe(model: type[BaseModel], path: str, array: bool, sections: list[str],
              used: set[str]) -> None:
    """Append the section of ``model`` at ``path``, then those of the tables inside it."""
    rows: list[str] = []
    nested: list[tuple[type[BaseModel], str, bool]] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        inner, shape = _table_of(field.annotation)
        if inner is not None and shape == "map":
            nested.append((inner, f"{key}.NAME", False))
            continue
        if inner is not None:
            nested.append((inner, key, shape == "array"))
        if not path:
            continue  # the top level holds only tables
        rows.append(f"| `{name}` | {_field_type(field)}{_constraints(field)} | "
                    f"{_default(model, name, field)} | {_meaning(key, field, used)} |\n")
    if rows:
        title = f"[[{path}]]" if array else f"[{path}]"
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        sections.append(f"\n## `{title}`\n\n{doc}\n\n| key | type | default | meaning |\n"
                        "|---|---|---|---|\n" + "".join(rows))
    for inner, key, inner_array in nested:
        _describe(inner, key, inner_array, sections, used)


def _table_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds, and how: ``table``, ``map`` (by name) or ``array``."""
    annotation = _strip_optional(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "table"
    if origin is dict and _is_model(args[1]):
        return args[1], "map"
    if origin is list and _is_model(args[0]):
        return args[0], "array"
    return None, ""


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _field_type(field: FieldInfo) -> str:
    """A field's type in TOML's words (pydantic keeps a field's own validators apart)."""
    return _validated_type(field.metadata) or _type(field.annotation)


def _validated_type(metadata: Any) -> str:
    for meta in metadata:
        name = getattr(getattr(meta, "func", None), "__name__", "")
        if name in _VALIDATOR_TYPES:
            return _VALIDATOR_TYPES[name]
    return ""


def _type(annotation: Any) -> str:
    """A field's type in TOML's words."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _validated_type(args[1:]) or _type(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None))
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        inner = _table_of(args[0])[0]
        return "array of tables" if inner is not None else f"array of {_type(args[0])}"
    if origin is dict:
        return f"table of {_type(args[1])} by {_type(args[0])}"
    if _is_model(annotation):
        return "table"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="),
           (annotated_types.MinLen, "min_length", "entries >="))


def _constraints(field: FieldInfo) -> str:
    """The field's bounds (``, > 0, <= 256``), or ''."""
    parts = [f"{word} {getattr(meta, attribute)}" for meta in field.metadata
             for kind, attribute, word in _BOUNDS if isinstance(meta, kind)]
    return f", {', '.join(parts)}" if parts else ""


def _default(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    applies = _APPLIES.get(model)
    if value is None and applies is not None:
        default = next(f.default for f in dataclasses.fields(applies) if f.name == name)
        if default is dataclasses.MISSING:  # worked out from other fields (fuel, from timeout_s)
            return f"unset: derived (`wasibox.{applies.__name__}.{name}`)"
        return f"unset: {_shown(default, field)} (`wasibox.{applies.__name__}`)"
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "(table)"
    return _shown(value, field)


def _shown(value: Any, field: FieldInfo) -> str:
    """A default as TOML would write it; sizes with their largest whole unit."""
    if _field_type(field) == "size" and value:
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value % scale == 0:
                return f"`\"{value // scale}{unit}\"`"
    return f"`{json.dumps(value)}`"


def _meaning(key: str, field: FieldInfo, used: set[str]) -> str:
    meaning = field.description or MEANINGS.get(key)
    if key in MEANINGS:
        used.add(key)
    if not meaning:
        raise LookupError(f"the configuration key {key} has no meaning: give its field a "
                          "description, or add it to MEANINGS in "
                          "wasibox/services/config_reference.py")
    return meaning.replace("|", "\\|")
