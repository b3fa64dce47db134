"""What every part of the topology schema shares: the error a bad topology raises, the strict model base
(an unknown key is an error, never a silently ignored knob), the node kinds, and the two marks a field
can carry in ``json_schema_extra``: ``experimental`` (config/knobs.py refuses a non-default value unless
the topology sets ``experimental: true``) and ``secret`` (node_configs.SECRET: redacted in dumps).

Nothing here imports another module of areal_bus/config, so each of them (placement.py included) can
import it without a cycle.
"""

from __future__ import annotations

import types
from typing import Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Tag

NODE_KINDS = ("bus", "gateway", "agent", "rollout", "reward", "trainer", "weights", "probe")

EXPERIMENTAL = "experimental"
"""``Field(json_schema_extra={EXPERIMENTAL: True})``: any value but the default is experimental;
``{EXPERIMENTAL: ["a", "b"]}``: those values are (the field itself is stable)."""


class TopologyError(ValueError):
    """An invalid topology file; the message names the file, the field and what is allowed."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def experimental(values: bool | list[str] = True) -> dict:
    """The ``json_schema_extra`` of an experimental field (``values``: only those values are)."""
    return {EXPERIMENTAL: values}


def section_model(annotation) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``), else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def tagged_kinds(annotation) -> dict[str, type[BaseModel]] | None:
    """{tag: model} of a discriminated union written as ``Union[Annotated[Model, Tag('x')], ...]``
    (how the engines choose their schema by ``kind``), else None."""
    if get_origin(annotation) is not Union:
        return None
    kinds = {}
    for member in get_args(annotation):
        model, *meta = get_args(member) or (member,)
        tag = next((m.tag for m in meta if isinstance(m, Tag)), None)
        if tag is None:
            return None
        kinds[tag] = model
    return kinds


def experimental_in_use(model: BaseModel, prefix: str = "") -> list[str]:
    """``path (value)`` of every experimental field (see EXPERIMENTAL) that ``model`` (a validated section,
    or the whole topology) sets to an experimental value, sections walked recursively."""
    found = []
    for name, info in type(model).model_fields.items():
        value, path = getattr(model, name), f"{prefix}{info.alias or name}"
        marked = info.json_schema_extra.get(EXPERIMENTAL) if isinstance(info.json_schema_extra, dict) else None
        if (marked is True and value != info.get_default(call_default_factory=True)) or \
                (isinstance(marked, list) and value in marked):
            found.append(f"{path} ({str(value).lower() if isinstance(value, bool) else repr(value)})")
        elif isinstance(value, BaseModel):
            found += experimental_in_use(value, f"{path}.")
    return found
