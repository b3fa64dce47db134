"""Structured output: JSON schemas and forced or strict tool calls as one grammar the policy samples under.

The gateway turns what a request asks of its reply's shape into xgrammar EBNF text (the wire's
``GenerateRequest.grammar``); the rollout worker compiles it for its tokenizer and masks each sampling
step with it, so the reply is valid by construction (a reply cut by max_tokens is "length", not valid):

- ``response_format`` json_object / json_schema (Responses ``text.format``, Anthropic
  ``output_config.format``): the content is a JSON object / a value of the schema. ``strict: true``
  also forbids properties the schema does not name (xgrammar's strict_mode); ``strict`` false or absent
  allows them where the schema does not say. A reasoning family's ``<think>`` block may come first.
- ``tool_choice`` required / a named function (Anthropic any / tool): the family's call opening is
  given in the prompt (``shaping``), and the grammar is the rest: for required one of the tools' names
  and its arguments, for a named function its arguments, then the family's call end (and, for
  required under parallel_tool_calls, more whole calls). Every tool's arguments follow its schema.
- a ``strict: true`` tool under tool_choice auto: free text until the family's trigger opens a call
  (``<tool_call>``, ``{"name": ``, ``[TOOL_CALLS]``: xgrammar's triggered tags); from there the call
  must name one of the tools, a strict tool's arguments valid for its schema (another tool's any JSON
  object), then the call's end. With a response_format as well, the reply is the JSON content or calls.

Schemas are checked first (``check_schema``): a keyword xgrammar refuses or would silently not apply
is a ``SchemaError`` naming it and where it is (the caller's 400), never a grammar that lets through what
the schema forbids. Found by trying each keyword against xgrammar 0.2.9 (tests/test_gateway_structured.py
keeps the table honest): ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``,
``dependentSchemas``, ``uniqueItems``, ``contains``, ``unevaluatedProperties``, ``$dynamicRef``,
``nullable``, ``allOf`` of more than one schema, a remote or anchor ``$ref``, keywords beside a ``$ref``
or an ``anyOf`` / ``oneOf`` / ``allOf``, ``multipleOf`` on a number, a ``required`` name that is not in
``properties``, a string / number / size keyword without the ``type`` it applies to, and formats it does
not know are accepted by it and NOT applied; a schema it cannot build (a bad regex, a dangling ``$ref``)
is refused with its message.

JSON is written compact, as json.dumps writes it (``JSON_SEPARATORS``), its properties in the schema's
order. Compiled once: a schema's grammar is cached by its canonical JSON (with strict), and a composed
grammar by what it was composed from (``GRAMMAR_CACHE_BYTES``, LRU). A request checks its schemas when it
is parsed (pure Python, ``wanted``); its grammar is composed when it is served (``grammar``: a cache hit on
the event loop, a compile in a worker thread, so the loop never waits on xgrammar). xgrammar is imported
at the first compile: it imports torch (about 2 s and 200 MB here), which a gateway that is never asked
for structured output does not need.

    want = structured.wanted(response_format, tools, tool_choice, parallel)   # at parse: the checks
    text = await structured.grammar(want, formats, special)                    # per turn: "" or EBNF text
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from nodes.gateway.parsers import Formats, ThinkFormat, ToolFormat

JSON_SEPARATORS = (", ", ": ")
"""JSON is written in one layout, json.dumps' (``{"a": 1, "b": [2, 3]}``), the one tool calls are written
in: a grammar that allows any whitespace between tokens lets a policy spend its whole max_tokens on
newlines (small ones do: the shipped tiny policy wrote 60 newlines and no value), and RL policies start
small and weak."""

GRAMMAR_CACHE_BYTES = 64 << 20
"""Compiled grammar text kept (LRU, by size): an agent sends the same few schemas on every call, so
each is compiled once; 64 MB holds thousands of typical ones (a few KB each)."""

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "deprecated",
    "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "discriminator"})
"""Keywords that say something about a value but constrain nothing: accepted anywhere."""

REFUSED = {
    "not": "xgrammar cannot express a negation",
    "if": "xgrammar cannot express conditionals", "then": "xgrammar cannot express conditionals",
    "else": "xgrammar cannot express conditionals",
    "dependentRequired": "xgrammar does not apply it", "dependentSchemas": "xgrammar does not apply it",
    "dependencies": "xgrammar does not apply it",
    "uniqueItems": "xgrammar does not apply it (a grammar cannot compare items)",
    "contains": "xgrammar does not apply it", "minContains": "xgrammar does not apply 'contains'",
    "maxContains": "xgrammar does not apply 'contains'",
    "unevaluatedProperties": "xgrammar does not apply it: use additionalProperties",
    "$dynamicRef": "only local $ref pointers are resolved", "$dynamicAnchor": "only local $ref pointers are resolved",
    "$recursiveRef": "only local $ref pointers are resolved",
    "$recursiveAnchor": "only local $ref pointers are resolved",
    "nullable": "it is OpenAPI's, not JSON Schema's: use \"type\": [..., \"null\"] or anyOf with {\"type\": \"null\"}",
}
"""Keywords xgrammar accepts but does not apply (or cannot), and why: a 400 naming them."""

TYPED = {
    "minimum": ("integer", "number"), "maximum": ("integer", "number"), "exclusiveMinimum": ("integer", "number"),
    "exclusiveMaximum": ("integer", "number"), "multipleOf": ("integer",),
    "pattern": ("string",), "minLength": ("string",), "maxLength": ("string",), "format": ("string",),
    "minItems": ("array",), "maxItems": ("array",),
    "minProperties": ("object",), "maxProperties": ("object",), "patternProperties": ("object",),
    "propertyNames": ("object",),
}
"""Keywords xgrammar applies only beside a ``type`` naming one of these (without it they are dropped)."""

STRUCTURE = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "items",
                       "prefixItems", "unevaluatedItems", "anyOf", "oneOf", "allOf", "$ref", "$defs",
                       "definitions"})
"""Keywords applied as they are (checked below for what xgrammar does with them)."""

FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
"""String formats xgrammar applies; another format would be dropped."""

TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})

_COMBINATORS = ("anyOf", "oneOf", "allOf")


class SchemaError(ValueError):
    """A schema (or a part of one) the grammar cannot apply: ``param`` names where, as OpenAI names a field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# -- checking a schema --------------------------------------------------------------------------------

def check_schema(schema, param: str) -> None:
    """Raise SchemaError for the first keyword of ``schema`` (at ``param``) the grammar would not apply."""
    if isinstance(schema, bool):
        if not schema:
            raise SchemaError(f"The schema at '{param}' is false: no value can follow it.", param)
        return
    if not isinstance(schema, dict):
        raise SchemaError(f"Invalid schema at '{param}': a JSON Schema is an object (or true).", param)
    _check_siblings(schema, param)
    for key, value in schema.items():
        at = f"{param}.{key}"
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key in REFUSED:
            raise SchemaError(f"Unsupported JSON Schema keyword '{key}' at '{param}': {REFUSED[key]}, so the "
                              f"reply could not be guaranteed to follow the schema. Remove it (or check it "
                              f"yourself after the reply).", at)
        if key in TYPED:
            _check_typed(schema, key, value, param)
        elif key not in STRUCTURE:
            raise SchemaError(f"Unknown JSON Schema keyword '{key}' at '{param}': the gateway applies only the "
                              f"keywords it knows the grammar enforces (names starting 'x-' are ignored as "
                              f"annotations).", at)
    _check_structure(schema, param)


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _check_typed(schema: dict, key: str, value, param: str) -> None:
    kinds = TYPED[key]
    types = _types(schema)
    if key in ("minItems", "maxItems") and ("items" in schema or "prefixItems" in schema):
        types.add("array")
    if not types & set(kinds) or (key == "multipleOf" and "number" in types):
        need = " or ".join(f"'type': '{k}'" for k in kinds)
        raise SchemaError(f"Unsupported use of '{key}' at '{param}': xgrammar applies it only beside {need}"
                          + (" (not on a number)" if key == "multipleOf" else "") + ", and drops it otherwise.",
                          f"{param}.{key}")
    if key.startswith("exclusive") and isinstance(value, bool):
        raise SchemaError(f"Unsupported '{key}' at '{param}': a number (draft 2020-12), not draft 4's boolean.",
                          f"{param}.{key}")
    if key == "format" and value not in FORMATS:
        raise SchemaError(f"Unsupported string format {value!r} at '{param}': xgrammar applies only "
                          f"{', '.join(sorted(FORMATS))}.", f"{param}.format")
    if key == "patternProperties":
        if not isinstance(value, dict):
            raise SchemaError(f"Invalid 'patternProperties' at '{param}': an object of schemas.", f"{param}.{key}")
        for name, sub in value.items():
            check_schema(sub, f"{param}.{key}.{name}")
    if key == "propertyNames":
        check_schema(value, f"{param}.{key}")


def _check_siblings(schema: dict, param: str) -> None:
    """A $ref, anyOf, oneOf or allOf with constraints beside it: xgrammar applies one side only."""
    constraints = [k for k in schema if k not in ANNOTATIONS and k not in ("$defs", "definitions")
                   and not k.startswith("x-")]
    ref = schema.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"Unsupported '$ref' at '{param}': {ref!r}; only local pointers ('#' or '#/...') are "
                              f"resolved (no remote schemas, no anchors).", f"{param}.$ref")
        if len(constraints) > 1:
            others = ", ".join(k for k in constraints if k != "$ref")
            raise SchemaError(f"Unsupported keywords beside '$ref' at '{param}' ({others}): xgrammar follows the "
                              f"reference and drops them; move them into the referenced schema.", f"{param}.$ref")
    for comb in _COMBINATORS:
        if comb not in schema:
            continue
        branches = schema[comb]
        if not isinstance(branches, list) or not branches:
            raise SchemaError(f"Invalid '{comb}' at '{param}': a non-empty list of schemas.", f"{param}.{comb}")
        if comb == "allOf" and len(branches) > 1:
            raise SchemaError(f"Unsupported 'allOf' of {len(branches)} schemas at '{param}': xgrammar applies "
                              f"only an allOf of one schema; merge them into one.", f"{param}.allOf")
        if len(constraints) > 1:
            others = ", ".join(k for k in constraints if k != comb)
            raise SchemaError(f"Unsupported keywords beside '{comb}' at '{param}' ({others}): xgrammar applies one "
                              f"and drops the other; move them into each branch.", f"{param}.{comb}")


def _check_structure(schema: dict, param: str) -> None:
    t = schema.get("type")
    for kind in ([t] if isinstance(t, str) else t if isinstance(t, list) else [] if t is None else [t]):
        if kind not in TYPES:
            raise SchemaError(f"Invalid 'type' at '{param}': {kind!r} is not one of {', '.join(sorted(TYPES))}.",
                              f"{param}.type")
    for comb in _COMBINATORS:
        for i, sub in enumerate(schema.get(comb) or ()):
            check_schema(sub, f"{param}.{comb}[{i}]")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise SchemaError(f"Invalid 'properties' at '{param}': an object of schemas.", f"{param}.properties")
        for name, sub in props.items():
            check_schema(sub, f"{param}.properties.{name}")
    required = schema.get("required")
    if required is not None:
        missing = [r for r in required if r not in (props or {})] if isinstance(required, list) else [required]
        if missing:
            raise SchemaError(f"Unsupported 'required' at '{param}': {missing[0]!r} is not in its 'properties', and "
                              f"xgrammar applies 'required' only to properties it names.", f"{param}.required")
    for key in ("additionalProperties", "items", "unevaluatedItems"):
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{param}.{key}")
    prefix = schema.get("prefixItems") or []
    if not isinstance(prefix, list):
        raise SchemaError(f"Invalid 'prefixItems' at '{param}': a list of schemas.", f"{param}.prefixItems")
    for i, sub in enumerate(prefix):
        check_schema(sub, f"{param}.prefixItems[{i}]")
    for key in ("$defs", "definitions"):
        defs = schema.get(key) or {}
        if not isinstance(defs, dict):
            raise SchemaError(f"Invalid '{key}' at '{param}': an object of schemas.", f"{param}.{key}")
        for name, sub in defs.items():
            check_schema(sub, f"{param}.{key}.{name}")


# -- compiling ----------------------------------------------------------------------------------------

class _Cache:
    """LRU of compiled grammar text, bounded by the bytes it holds; safe across threads (compiles run in
    worker threads)."""

    def __init__(self, max_bytes: int = GRAMMAR_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.items: OrderedDict = OrderedDict()
        self.bytes = 0
        self.compiles = 0  # grammars built (cache misses that compiled), for tests and the bench
        self._lock = threading.Lock()

    def get(self, key) -> str | None:
        with self._lock:
            text = self.items.get(key)
            if text is not None:
                self.items.move_to_end(key)
            return text

    def put(self, key, text: str) -> str:
        size = _size(key, text)
        with self._lock:
            self.compiles += 1
            if size > self.max_bytes // 16 or key in self.items:  # compiled and used, not kept (or kept already)
                return text
            self.items[key] = text
            self.bytes += size
            while self.bytes > self.max_bytes:
                old, old_text = self.items.popitem(last=False)
                self.bytes -= _size(old, old_text)
        return text


def _size(key: tuple, text: str) -> int:
    return len(text) + sum(len(k) for k in key if isinstance(k, str))


CACHE = _Cache()
"""One per process: a schema's grammar does not depend on the gateway that compiled it."""

_XG_PREFIX = re.compile(r"^\[[\d:]+\] [^:]+:\d+: ")


def canonical(schema) -> str:
    """A schema's cache key: its compact JSON, keys in the order sent (the order of ``properties`` is the
    order the reply writes them in, so two orders are two grammars)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Schema:
    """A checked JSON schema to compile: its canonical JSON, xgrammar's strict_mode, and the field it came from."""
    json: str
    strict: bool
    param: str


ANY_OBJECT = Schema(canonical({"type": "object"}), False, "")
"""The arguments of a tool whose own are not constrained (a non-strict tool beside a strict one), and
json_object's content."""


def schema(value, strict: bool, param: str) -> Schema:
    """``value`` checked (check_schema) as the schema of a grammar; one compiled already passed the check."""
    s = Schema(canonical(value), strict, param)
    if CACHE.get(("json", s.json, s.strict)) is None:
        check_schema(value, param)
    return s


def json_grammar(s: Schema) -> str:
    """The grammar text of a JSON value of ``s``, compiled once per canonical schema and strictness."""
    key = ("json", s.json, s.strict)
    text = CACHE.get(key)
    if text is not None:
        return text
    try:
        grammar = _xgrammar().Grammar.from_json_schema(s.json, strict_mode=s.strict, any_whitespace=False,
                                                       separators=JSON_SEPARATORS)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's own refusal: the client's schema
        why = _XG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        raise SchemaError(f"Invalid schema at '{s.param}': {why.rstrip('.')}.", s.param) from None
    return CACHE.put(key, str(grammar))


def _xgrammar():
    # lazy: xgrammar imports torch (~2 s, ~200 MB); only a gateway asked for structured output pays it
    import xgrammar

    return xgrammar


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    args: Schema  # its arguments object


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a request asks of its replies' shape, checked: ``content`` the schema of a JSON content (None:
    free text); ``tools`` the tools a call may name, with their arguments' schemas (empty: calls are not
    constrained); ``mode`` auto / required / named (the forced call's function is ``tools[0]``); ``why``
    the field that made calls constrained under auto (a strict tool's, or response_format)."""
    content: Schema | None = None
    tools: tuple[Tool, ...] = ()
    mode: str = "auto"
    parallel: bool = True
    why: str = ""

    @property
    def empty(self) -> bool:
        return self.content is None and not self.tools


NOTHING = Wanted()


def wanted(response_format: dict | None, tools: list[dict] | None, tool_choice, parallel: bool | None) -> Wanted:
    """Check what a chat request asks (``tools``: its tools as dicts, already validated; None when
    tool_choice is none). Raises SchemaError naming the field for a schema the grammar cannot apply."""
    content = _content(response_format)
    tools = tools or []
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    strict = [bool(t["function"].get("strict")) for t in tools]
    if not tools or not (forced or any(strict) or content is not None):
        return Wanted(content) if content is not None else NOTHING
    checked = []
    for i, t in enumerate(tools):
        fn = t["function"]
        if named is not None and fn["name"] != named:
            continue
        if forced or strict[i]:
            args = schema(fn.get("parameters") or {"type": "object"}, strict[i], f"tools[{i}].function.parameters")
        else:
            args = ANY_OBJECT
        checked.append(Tool(fn["name"], args))
    mode = "named" if named is not None else "required" if forced else "auto"
    why = f"tools[{strict.index(True)}].function.strict" if True in strict else "response_format"
    return Wanted(content, tuple(checked), mode, parallel is not False, why)


def _content(fmt: dict | None) -> Schema | None:
    kind = (fmt or {}).get("type")
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = fmt["json_schema"]
        return schema(spec.get("schema", {"type": "object"}), bool(spec.get("strict")),
                      "response_format.json_schema.schema")
    return None


# -- composing ----------------------------------------------------------------------------------------

async def grammar(want: Wanted, formats: Formats, special: frozenset[str] = frozenset()) -> str:
    """``compose``, with its compile (a cache miss) in a worker thread: the event loop never waits on it."""
    if want.empty:
        return ""
    hit = CACHE.get(_key(want, formats))
    if hit is not None:
        _refuse_special(want, formats, special)
        return hit
    return await asyncio.to_thread(compose, want, formats, special)


def compose(want: Wanted, formats: Formats, special: frozenset[str] = frozenset()) -> str:
    """The grammar text for a turn ("" for none), cached by what it is made of. ``special``: the policy
    tokenizer's special tokens (never grammar text: the engines keep them out of every grammar). Raises
    SchemaError for a schema xgrammar cannot build, or calls this model's format cannot constrain."""
    if want.empty:
        return ""
    _refuse_special(want, formats, special)
    key = _key(want, formats)
    if key[0] == "json":  # the JSON grammar itself
        return json_grammar(want.content)
    text = CACHE.get(key)
    if text is not None:
        return text
    tag = {"type": "structural_tag", "format": _format(want, formats.tools, formats.think)}
    return CACHE.put(key, str(_xgrammar().Grammar.from_structural_tag(tag)))


def _key(want: Wanted, formats: Formats) -> tuple:
    if want.content is not None and not want.tools and formats.think is None:
        return "json", want.content.json, want.content.strict
    return ("turn", formats.tools.name, repr(formats.think), want.mode, want.parallel,
            *((want.content.json, want.content.strict) if want.content is not None else ("", False)),
            *(v for t in want.tools for v in (t.name, t.args.json, t.args.strict)))


def _refuse_special(want: Wanted, formats: Formats, special: frozenset[str]) -> None:
    if want.mode == "auto" and want.tools and formats.tools.trigger in special:
        raise SchemaError(f"Calls cannot be constrained under tool_choice auto for this model: its calls begin "
                          f"with the special token {formats.tools.trigger}, which no grammar can match (a grammar "
                          f"is text; the engines keep special tokens out of it), so a grammar here would keep the "
                          f"model from calling any tool. Send tool_choice required or a named function (its call "
                          f"is given that token and then constrained), or no strict tool / response_format with "
                          f"tools.", want.why)


# xgrammar structural tags, as the JSON its from_structural_tag reads (no need of its pydantic classes).

def _format(want: Wanted, fmt: ToolFormat, think: ThinkFormat | None) -> dict:
    if want.mode != "auto":  # the prompt ends with the forced opening: the rest of the call(s)
        return _forced(want, fmt)
    if want.content is None and fmt.head:  # text, then the calls' block (Mistral's: it ends the reply)
        block = _tag(fmt.head, _separated(want, fmt), fmt.tail)
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [block], "stop_after_first": True}
    elif want.content is None:  # text, and calls of the tools when the model opens one
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [_call(t, fmt) for t in want.tools],
                "stop_after_first": not want.parallel}
    elif want.tools:
        body = _either([_json(want.content), _calls(want, fmt)])
    else:
        body = _json(want.content)
    return _seq([*_think(think), body])


def _forced(want: Wanted, fmt: ToolFormat) -> dict:
    if want.mode == "named":
        return _seq([_json(want.tools[0].args), _const(fmt.call_close + fmt.tail)])
    name_on = [_seq([_const(fmt.call_head(t.name)[len(fmt.call_open):]), _json(t.args), _const(fmt.call_close)])
               for t in want.tools]
    parts = [_either(name_on)]
    if want.parallel:
        parts.append({"type": "star", "content": _seq([_const(fmt.separator),
                                                       _either([_call(t, fmt) for t in want.tools])])})
    if fmt.tail:
        parts.append(_const(fmt.tail))
    return _seq(parts)


def _calls(want: Wanted, fmt: ToolFormat) -> dict:
    """One or more whole calls (one if not parallel) and nothing else: the reply when it is not content."""
    return _seq([*([_const(fmt.head)] if fmt.head else []), _separated(want, fmt),
                 *([_const(fmt.tail)] if fmt.tail else [])])


def _separated(want: Wanted, fmt: ToolFormat) -> dict:
    return {"type": "tags_with_separator", "tags": [_call(t, fmt) for t in want.tools], "separator": fmt.separator,
            "at_least_one": True, "stop_after_first": not want.parallel}


def _call(tool: Tool, fmt: ToolFormat) -> dict:
    return _tag(fmt.call_head(tool.name), _json(tool.args), fmt.call_close)


def _think(think: ThinkFormat | None) -> list[dict]:
    """A reasoning family's <think> block before the rest (required when the prompt opened it)."""
    if think is None:
        return []
    block = _seq([_tag("" if think.starts_open else think.OPEN, {"type": "any_text"}, think.CLOSE),
                  {"type": "regex", "pattern": "\\n{0,2}"}])
    return [block] if think.starts_open else [{"type": "optional", "content": block}]


def _json(s: Schema) -> dict:
    return {"type": "grammar", "grammar": json_grammar(s)}


def _tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _seq(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _either(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}
