"""Every knob of a topology, read from the schema itself: its dotted path, type, default, bounds, the
engine kind it belongs to, whether it is experimental, and its description. ``areal-bus knobs`` prints
them; ``areal-bus knobs --markdown > docs/knobs.md`` writes the reference (tests/test_knobs.py fails
when that file is stale).
"""

from __future__ import annotations

import textwrap
import types
from dataclasses import dataclass
from typing import Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from areal_bus.config.base import EXPERIMENTAL, section_model, tagged_kinds
from areal_bus.config.root import Topology
from areal_bus.config.sections import PLUGIN

REFRESH = ".venv/bin/areal-bus knobs --markdown > docs/knobs.md"


@dataclass
class Knob:
    path: str
    type: str
    default: str
    bounds: str
    kind: str  # the engine kind it belongs to ('' for every kind, and outside the engines)
    experimental: str  # '' | 'yes' | the experimental values
    description: str

    @property
    def section(self) -> str:
        return self.path.split(".")[0] if "." in self.path else ""


def knobs(model: type[BaseModel] = Topology, prefix: str = "") -> list[Knob]:
    """Every leaf field under ``model``, in schema order (a section's fields where the section is)."""
    rows: list[Knob] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        kinds = tagged_kinds(info.annotation)
        sub = section_model(info.annotation)
        if kinds is not None:
            rows += _kind_rows(kinds, f"{path}.")
        elif sub is not None:
            rows += knobs(sub, f"{path}.")
        else:
            rows.append(_row(path, info))
    return rows


def _kind_rows(kinds: dict, prefix: str) -> list[Knob]:
    """A kind-chosen section: the fields every kind has once, the others marked with their kind."""
    per_kind = {kind: knobs(model, prefix) for kind, model in kinds.items()}
    shared = set.intersection(*({r.path for r in rows} for rows in per_kind.values()))
    out, seen = [], set()
    for kind, rows in per_kind.items():
        for r in rows:
            if r.path in seen:
                continue
            seen.add(r.path)
            if r.path == f"{prefix}kind":
                r.type, r.default = " | ".join(f"'{k}'" for k in kinds), f"'{next(iter(kinds))}'"
            elif r.path not in shared:
                r.kind = kind
            out.append(r)
    return out


def _row(path: str, info) -> Knob:
    default = info.get_default(call_default_factory=True)
    marked = info.json_schema_extra.get(EXPERIMENTAL) if isinstance(info.json_schema_extra, dict) else None
    return Knob(path=path, type=_type_name(info.annotation),
                default="(required)" if default is PydanticUndefined else _yaml(default),
                bounds=_bounds(info.metadata), kind="",
                experimental="yes" if marked is True else ", ".join(_yaml(v) for v in marked or ()),
                description=" ".join((info.description or "").split()))


def _type_name(ann) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(_yaml(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if ann is dict or origin is dict:
        return "mapping"
    return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))


def _yaml(value) -> str:
    """A value as a topology would write it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) if "\n" not in value else "(a multi-line text)"
    return repr(value)


def _bounds(metadata) -> str:
    said = []
    for m in metadata:
        for cls, attr, sign in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<"),
                                (MinLen, "min_length", "length >="), (MaxLen, "max_length", "length <=")):
            if isinstance(m, cls):
                said.append(f"{sign} {getattr(m, attr):,}" if isinstance(getattr(m, attr), int) else
                            f"{sign} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            said.append(f"matches {m.pattern.replace(PLUGIN, '<package.module:Name>')}")
    return ", ".join(said)


# -- output ----------------------------------------------------------------------------------------

def text(rows: list[Knob] | None = None) -> str:
    """One entry per knob: ``path: type = default  [bounds]  (kind K)  EXPERIMENTAL`` and its description."""
    rows, lines = knobs() if rows is None else rows, []
    for k in rows:
        head = f"{k.path}: {k.type} = {k.default}"
        head += f"  [{k.bounds}]" if k.bounds else ""
        head += f"  (kind {k.kind})" if k.kind else ""
        head += "" if not k.experimental else "  EXPERIMENTAL" if k.experimental == "yes" else \
            f"  EXPERIMENTAL values: {k.experimental}"
        lines += [head, *textwrap.wrap(k.description, 100, initial_indent="    ", subsequent_indent="    ",
                                                 break_on_hyphens=False)]
    lines.append(f"\n{len(rows)} knobs; experimental ones need `experimental: true` at the top of the topology.")
    return "\n".join(lines)


def markdown() -> str:
    """docs/knobs.md (without its final newline, which print adds): a table per top-level section."""
    rows = knobs()
    out = ["# Topology knobs", "",
           f"Generated from the schema (areal_bus/config/) by `{REFRESH}`; do not edit by hand",
           "(tests/test_knobs.py fails when this file is stale). Why a knob has its default, and what was",
           "measured: [knob-notes.md](knob-notes.md).", "",
           "**Kind**: the `rollout_engine.kind` / `trainer_engine.kind` a field belongs to; a field of another",
           "kind is refused. **Experimental**: a non-default value (or the values named) is refused unless the",
           "topology sets `experimental: true` at its top.", "",
           f"{len(rows)} knobs, {sum(1 for k in rows if k.experimental)} of them experimental.", ""]
    sections: dict[str, list[Knob]] = {}
    for k in rows:
        sections.setdefault(k.section, []).append(k)
    for section, group in sections.items():
        field = next((f for n, f in Topology.model_fields.items() if section in (n, f.alias)), None)
        about = field.description if field is not None else "The run's own knobs."
        out += [f"## {section or 'Top level'}", "", about, "",
                "| Knob | Type | Default | Bounds | Kind | Experimental | Description |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        out += ["| " + " | ".join((f"`{k.path}`", _code(k.type), _code(k.default), _code(k.bounds), k.kind,
                                   _code(k.experimental), _text(k.description))) + " |" for k in group]
        out.append("")
    return "\n".join(out).rstrip("\n")


_PIPE = "\\|"  # a pipe inside a table cell, even in code, would end the cell


def _code(value: str) -> str:
    return f"`{value.replace('|', _PIPE)}`" if value and value != "yes" else value


def _text(value: str) -> str:
    # prose in a table cell: <name> would be read as an HTML tag
    return value.replace("|", _PIPE).replace("<", "&lt;")
