"""A topology from a YAML file: read it, expand ``${NAME}`` / ``${NAME:-default}`` from the environment,
validate it (one TopologyError listing every problem, each with its field path and what is allowed),
and dump it resolved with its secrets redacted (what every node logs at start).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from areal_bus.config.base import TopologyError, section_model, tagged_kinds
from areal_bus.config.node_configs import REDACTED, SECRET
from areal_bus.config.root import Topology

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value, path: str, source: str):
    if isinstance(value, str):
        def sub(m):
            name, default = m.group(1), m.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise TopologyError(f"{source}: {path}: environment variable ${{{name}}} is not set "
                                f"(export it in this shell, or write ${{{name}:-default}})")
        return _ENV.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{path}.{k}" if path else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    return value


def _format_errors(source: str, err: ValidationError, model=Topology) -> str:
    lines = [f"{source}: invalid topology ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        loc = ".".join(_walk(model, e["loc"])[0]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(_walk(model, e["loc"][:-1])[1])
            msg = f"unknown field; allowed here: {', '.join(allowed)}" if allowed else \
                "unknown field; this node kind takes no config (its knobs are top-level fields)"
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) \
            or loc.endswith("admin_token") else f" (got {got!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _walk(model, loc) -> tuple[list[str], type[BaseModel] | None]:
    """(the path a user wrote, the model at its end) for an error location: pydantic puts the tag of a
    kind-chosen section in it (``rollout_engine.torch.max_len``), which is no key of the file."""
    shown, parts = [], list(loc)
    while parts:
        part = parts.pop(0)
        shown.append(str(part))
        if model is None:
            continue
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        ann = getattr(field, "annotation", None)
        if get_origin(ann) is dict and parts:
            shown.append(str(parts.pop(0)))  # the key: every value of the mapping has one schema
            ann = get_args(ann)[1]
        kinds = tagged_kinds(ann)
        if kinds is not None and parts and parts[0] in kinds:
            model = kinds[parts.pop(0)]
        else:
            model = section_model(ann)
    return shown, model


def _allowed_fields(model) -> list[str]:
    return [] if model is None else sorted(f.alias or n for n, f in model.model_fields.items())


def parse_topology(data, source: str = "<topology>") -> Topology:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: a topology is a YAML mapping of fields, got {type(data).__name__}")
    data = _expand(data, "", source)
    try:
        return Topology.model_validate(data)
    except ValidationError as err:
        raise TopologyError(_format_errors(source, err)) from None


def read_yaml(path: str | os.PathLike, what: str, error: type[Exception]):
    """A YAML file's data, or ``error`` with one message naming the file (shared by every config)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_topology(path: str | os.PathLike) -> Topology:
    """Read, expand and validate a topology file. Raises TopologyError with one clear message."""
    return parse_topology(read_yaml(path, "topology", TopologyError), str(path))


def dump_resolved(topo: Topology) -> dict:
    """The fully resolved configuration, as logged at node start (logs/resolved/<node>.json) and printed
    by `areal-bus validate`, with every secret-marked field (node_configs.SECRET: the gateway's
    admin_token) shown as REDACTED: these files are read by people and tools, and outlive the run.
    Read back, a redacted token is unset (the trainer's other ranks need none)."""
    return _redact(topo, topo.model_dump(mode="json", by_alias=True))


def _redact(model: BaseModel, dumped: dict) -> dict:
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        if key not in dumped:  # Nodes dumps only the listed kinds
            continue
        value = getattr(model, name)
        if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(SECRET):
            dumped[key] = None if value is None else REDACTED
        elif isinstance(value, BaseModel) and isinstance(dumped[key], dict):
            _redact(value, dumped[key])
    return dumped
