"""Structured output on the gateway's side (nodes/gateway/structured.py), with no server: what a request asks
of its reply's shape becomes one xgrammar grammar, checked with xgrammar's own matcher on strings.

- A JSON schema's grammar accepts what the schema allows and nothing else, in json.dumps' layout and the
  schema's property order; each schema is compiled once (the cache).
- A keyword xgrammar would not apply is refused naming it; the table is kept honest both ways: xgrammar
  really does let through what each refused keyword forbids (if a new xgrammar applies one, its test here
  fails and the keyword can move to the supported side), and the supported ones really are applied.
- Forced calls (required / a named function: the rest of the call after the opening the prompt is given),
  a strict tool under auto (free text, or a call whose arguments follow the schema) and JSON content with
  tools, in each family's format (Hermes, Llama 3 JSON, Mistral), and a <think> block first for a
  reasoning family.

    .venv/bin/python -m pytest tests/test_gateway_structured.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import xgrammar as xg
from xgrammar.testing import _is_grammar_accept_string as accepts

from nodes.gateway import structured
from nodes.gateway.openai_api import OpenAIError, parse_chat_request
from nodes.gateway.parsers import TOOL_FORMATS, Formats, ThinkFormat

M = [{"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FAMILIES = ["hermes", "llama3_json", "mistral"]


def schema_format(schema, strict=True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def grammar(body: dict, family: str = "hermes", think: ThinkFormat | None = None, special=frozenset()) -> str:
    req = parse_chat_request({"model": "policy", "messages": M, **body})
    return structured.compose(req.wanted, Formats(TOOL_FORMATS[family], think), special)


def refusal(schema) -> structured.SchemaError:
    """The refusal of a json_schema: when the request is parsed (a 400 naming the field), or when its grammar
    is built (xgrammar's own refusals: the gateway answers them with the same 400)."""
    try:
        grammar({"response_format": schema_format(schema)})
    except OpenAIError as err:
        assert err.status == 400 and err.code == "invalid_schema"
        return structured.SchemaError(err.message, err.param)
    except structured.SchemaError as err:
        return err
    raise AssertionError(f"{schema} was not refused")


def xgrammar_accepts(schema, text: str) -> bool:
    """What xgrammar itself does with ``schema`` (no check of ours in between)."""
    return accepts(xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)


# -- JSON schemas --------------------------------------------------------------------------------------

def test_a_json_schema_grammar_accepts_its_values_in_one_layout_and_nothing_else():
    g = grammar({"response_format": schema_format({
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 16},
                                         "way": {"type": "string", "enum": ["higher", "lower"]}},
        "required": ["n", "way"], "additionalProperties": False})})
    assert accepts(g, '{"n": 8, "way": "higher"}')
    for bad in ('{"n": 17, "way": "higher"}', '{"n": 8, "way": "up"}', '{"way": "higher", "n": 8}',
                '{"n": 8}', '{\n  "n": 8, "way": "higher"}', '{"n": 8, "way": "higher", "x": 1}', 'sure: {"n": 8}'):
        assert not accepts(g, bad), bad


def test_strict_false_lets_properties_the_schema_does_not_name_through_and_strict_true_does_not():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(grammar({"response_format": schema_format(schema, strict=False)}), '{"a": 1, "b": 2}')
    assert not accepts(grammar({"response_format": schema_format(schema, strict=True)}), '{"a": 1, "b": 2}')


def test_json_object_is_any_json_object():
    g = grammar({"response_format": {"type": "json_object"}})
    assert accepts(g, '{"a": [1, {"b": null}], "c": "d"}') and accepts(g, "{}")
    assert not accepts(g, '"just a string"') and not accepts(g, "[1]")


def test_a_schema_is_compiled_once_and_its_property_order_is_part_of_its_key():
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    compiles = structured.CACHE.compiles
    first = grammar({"response_format": schema_format(schema)})
    assert structured.CACHE.compiles == compiles + 1
    assert grammar({"response_format": schema_format(json.loads(json.dumps(schema)))}) == first
    assert structured.CACHE.compiles == compiles + 1
    assert accepts(first, '{"zeta": 1, "alpha": true}') and not accepts(first, '{"alpha": true, "zeta": 1}')
    swapped = {**schema, "properties": {"alpha": {"type": "boolean"}, "zeta": {"type": "integer"}}}
    assert accepts(grammar({"response_format": schema_format(swapped)}), '{"alpha": true, "zeta": 1}')


def test_the_cache_is_bounded_by_bytes_and_drops_the_least_recently_used():
    cache = structured._Cache(max_bytes=16 * 100)
    for i in range(40):
        cache.put(("k", str(i)), "x" * 60)
    assert cache.bytes <= 16 * 100 and ("k", "39") in cache.items and ("k", "0") not in cache.items


# -- what xgrammar would not apply: refused, and the table kept honest ------------------------------

# (schema with the keyword, an instance the keyword forbids, the param our 400 names)
NOT_APPLIED = [
    ({"type": "string", "not": {"const": "a"}}, '"a"', "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}', "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]", "contains"),
    ({"type": "number", "multipleOf": 0.5}, "3.3", "multipleOf"),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 5}]}, "9", "allOf"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "maximum": 3}, "5", "$ref"),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": -3}]}, "0", "anyOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1}', "required"),
    ({"minLength": 3}, '"a"', "minLength"),
    ({"type": "string", "format": "iri"}, '"not an iri"', "format"),
    ({"type": "string", "nullable": True}, None, "nullable"),  # OpenAPI's: JSON Schema has no such keyword
]


@pytest.mark.parametrize("schema, forbidden, keyword", NOT_APPLIED, ids=[k for *_, k in NOT_APPLIED])
def test_a_keyword_xgrammar_would_not_apply_is_a_400_naming_it(schema, forbidden, keyword):
    err = refusal(schema)
    assert err.param == f"response_format.json_schema.schema.{keyword}" and keyword in str(err)
    if forbidden is not None:  # ...because xgrammar really does let through what it forbids
        assert xgrammar_accepts(schema, forbidden)


def test_a_refused_keyword_deep_in_a_schema_is_named_where_it_is():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "not": {"const": "x"}}}}, "required": ["tags"]}
    assert refusal(schema).param == "response_format.json_schema.schema.properties.tags.items.not"
    schema = {"$defs": {"Tag": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/Tag"}
    assert refusal(schema).param == "response_format.json_schema.schema.$defs.Tag.uniqueItems"


@pytest.mark.parametrize("schema, why", [
    ({"type": "string", "pattern": "(("}, "parenthesis"),
    ({"$ref": "#/$defs/Nope"}, "$defs"),
    ({"type": "strin"}, "strin"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "x_unknown": 1}, "x_unknown"),
], ids=["bad-regex", "dangling-ref", "bad-type", "remote-ref", "unknown-keyword"])
def test_a_schema_xgrammar_cannot_build_is_a_400_with_its_reason(schema, why):
    assert why in str(refusal(schema))


# (schema, an instance it allows, one it forbids): applied by the grammar
APPLIED = [
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 9}, "8", "9"),
    ({"type": "integer", "multipleOf": 3}, "6", "4"),
    ({"type": "string", "pattern": "^a+$"}, '"aa"', '"b"'),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    ({"type": "string", "format": "date"}, '"2024-01-02"', '"soon"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2]", "[]"),
    ({"type": ["string", "null"]}, "null", "1"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "maybe", "default": None}, "null", '"x"'),
    ({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                      "additionalProperties": False}}, "$ref": "#/$defs/P", "description": "a point"},
     '{"x": 1}', '{"y": 1}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", "[1, 2]"),
    ({"enum": ["a", 1, None]}, "1", "2"),
    ({"type": "object", "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": 2}'),
]


@pytest.mark.parametrize("schema, allowed, forbidden", APPLIED, ids=[f"applied-{i}" for i in range(len(APPLIED))])
def test_a_supported_keyword_is_applied_by_the_grammar(schema, allowed, forbidden):
    g = grammar({"response_format": schema_format(schema, strict=False)})
    assert accepts(g, allowed) and not accepts(g, forbidden)


def test_a_pydantic_models_strict_schema_as_the_openai_sdk_sends_it_is_served():
    from typing import Literal, Optional

    import pydantic
    from openai.lib._pydantic import to_strict_json_schema

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10, description="a city")
        country: Optional[str]

    class Plan(pydantic.BaseModel):
        steps: list[Literal["go", "stay"]]
        where: Place
        days: int = pydantic.Field(ge=1, le=9)

    g = grammar({"response_format": schema_format(to_strict_json_schema(Plan))})
    assert accepts(g, '{"steps": ["go", "stay"], "where": {"city": "Oslo", "country": null}, "days": 3}')
    assert not accepts(g, '{"steps": ["fly"], "where": {"city": "Oslo", "country": null}, "days": 3}')


# -- tool calls, per family ----------------------------------------------------------------------------

def call(family: str, name: str, args: str) -> str:
    f = TOOL_FORMATS[family]
    return f.call_head(name) + args + f.call_close


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_choice_required_is_the_rest_of_one_or_more_calls_each_valid_for_its_tool(family):
    f = TOOL_FORMATS[family]
    g = grammar({"tools": [WEATHER, TIME], "tool_choice": "required"}, family)
    rest = lambda text: text[len(f.call_open):]  # noqa: E731 (the prompt holds the head and the call's opening)
    one = rest(call(family, "get_weather", '{"city": "Paris"}'))
    assert accepts(g, one + f.tail)
    assert accepts(g, one + f.separator + call(family, "get_time", "{}") + f.tail)
    assert not accepts(g, rest(call(family, "get_weather", '{"city": "Paris, France"}')) + f.tail)  # maxLength
    assert not accepts(g, rest(call(family, "get_news", "{}")) + f.tail)  # not a tool
    assert not accepts(g, one[:-1])  # unfinished


@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_function_is_exactly_one_call_of_it(family):
    f = TOOL_FORMATS[family]
    g = grammar({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                family)
    assert accepts(g, '{"city": "Oslo"}' + f.call_close + f.tail)
    assert not accepts(g, '{"town": "Oslo"}' + f.call_close + f.tail)
    assert not accepts(g, '{"city": "Oslo"}' + f.call_close + f.separator + call(family, "get_time", "{}") + f.tail)


def test_parallel_tool_calls_false_allows_one_forced_call():
    g = grammar({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    one = call("hermes", "get_time", "{}")[len(TOOL_FORMATS["hermes"].call_open):]
    assert accepts(g, one) and not accepts(g, one + "\n" + call("hermes", "get_time", "{}"))


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_a_strict_tool_under_auto_leaves_text_free_and_constrains_its_call(family):
    g = grammar({"tools": [WEATHER, TIME]}, family)
    good = call(family, "get_weather", '{"city": "Paris"}')
    lead = "Let me check. " if family == "hermes" else ""  # Llama's reply is the call or text
    assert accepts(g, "Any text at all, with {braces} and <tags>.") and accepts(g, lead + good)
    assert not accepts(g, lead + call(family, "get_weather", '{"town": "Paris"}'))
    assert accepts(g, lead + call(family, "get_time", '{"any": ["json", 1]}'))  # a non-strict tool: any object


def test_a_strict_tool_under_auto_for_mistral_constrains_its_calls_array():
    g = grammar({"tools": [WEATHER, TIME]}, "mistral")
    f = TOOL_FORMATS["mistral"]
    calls = f.head + call("mistral", "get_weather", '{"city": "Oslo"}') + f.separator + call(
        "mistral", "get_time", "{}") + f.tail
    assert accepts(g, "Checking." + calls) and accepts(g, "No call.")
    assert not accepts(g, calls.replace('"city"', '"town"'))


def test_mistral_under_auto_is_a_400_when_its_call_token_is_special_for_the_tokenizer():
    with pytest.raises(structured.SchemaError) as err:
        grammar({"tools": [WEATHER, TIME]}, "mistral", special=frozenset({"[TOOL_CALLS]"}))
    assert err.value.param == "tools[0].function.strict" and "[TOOL_CALLS]" in str(err.value)
    assert grammar({"tools": [WEATHER], "tool_choice": "required"}, "mistral", special=frozenset({"[TOOL_CALLS]"}))


def test_no_strict_tool_under_auto_and_no_format_is_no_grammar():
    assert grammar({"tools": [TIME]}) == "" and grammar({}) == ""
    assert grammar({"tools": [WEATHER], "tool_choice": "none"}) == ""  # no tools offered


@pytest.mark.parametrize("family", FAMILIES)
def test_json_content_with_tools_is_the_content_or_calls(family):
    f = TOOL_FORMATS[family]
    g = grammar({"tools": [WEATHER, TIME], "response_format": schema_format(
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
         "additionalProperties": False})}, family)
    assert accepts(g, '{"answer": true}')
    assert accepts(g, f.head + call(family, "get_time", "{}") + f.tail)
    assert not accepts(g, "Some text.") and not accepts(g, '{"answer": "yes"}')


def test_a_reasoning_family_may_think_before_its_json():
    fmt = {"response_format": {"type": "json_object"}}
    g = grammar(fmt, think=ThinkFormat())
    assert accepts(g, '<think>\nThe user wants {JSON}.\n</think>\n\n{"a": 1}') and accepts(g, '{"a": 1}')
    assert not accepts(g, 'Here: {"a": 1}')
    opened = grammar(fmt, think=ThinkFormat(starts_open=True))  # the prompt opened the block
    assert accepts(opened, 'thinking...</think>\n\n{"a": 1}') and not accepts(opened, '{"a": 1}')


def test_a_tool_schema_the_grammar_cannot_apply_is_refused_only_when_it_would_be_applied():
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
    assert parse_chat_request({"model": "policy", "messages": M, "tools": [loose]})  # auto, not strict: unused
    with pytest.raises(OpenAIError) as err:
        parse_chat_request({"model": "policy", "messages": M, "tools": [loose], "tool_choice": "required"})
    assert err.value.param == "tools[0].function.parameters.uniqueItems"


def test_a_gateway_never_asked_for_structured_output_does_not_load_xgrammar_or_torch():
    code = "import sys, nodes.gateway.app; print(sorted(m for m in ('xgrammar', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"  # xgrammar imports torch: ~2 s and ~200 MB that only a schema needs
