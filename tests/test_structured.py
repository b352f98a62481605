"""Structured output and tool calls, through the server as a client uses them: JSON schemas (every
output validated with the jsonschema library), the openai client's own ``parse`` helper, tool calls
(plain and streamed), regex, choice and grammar constraints, logit_bias and allowed_token_ids, and
each bad constraint a 400 naming its field while a request in flight beside it goes on untouched.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import parse_metrics, start_server

ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                            "city": {"type": "string", "maxLength": 30}},
           "required": ["street", "city"], "additionalProperties": False}
# (what to ask for, the schema): together they cover nested objects, arrays with item bounds, enum and const,
# anyOf / oneOf, $ref / $defs, additionalProperties false, required and optional fields, string patterns,
# integer and number bounds, formats
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a person with an address", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                                   "address": ADDRESS},
                                  "required": ["name", "address"], "additionalProperties": False}),
    ("three colours", {"type": "object", "properties": {"colours": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}},
        "required": ["colours"], "additionalProperties": False}),
    ("up to two scores", {"type": "object", "properties": {"scores": {
        "type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10}, "minItems": 1, "maxItems": 2}},
        "required": ["scores"], "additionalProperties": False}),
    ("a traffic light", {"type": "object", "properties": {"light": {"enum": ["red", "amber", "green"]}},
                         "required": ["light"], "additionalProperties": False}),
    ("a version record", {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
                          "required": ["version", "ok"], "additionalProperties": False}),
    ("an id that is a number or a string", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 10}]}},
        "required": ["id"], "additionalProperties": False}),
    ("a shape", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}},
         "required": ["kind", "side"], "additionalProperties": False}]}),
    ("a home and a work address", {"$defs": {"address": ADDRESS}, "type": "object",
                                   "properties": {"home": {"$ref": "#/$defs/address"},
                                                  "work": {"$ref": "#/$defs/address"}},
                                   "required": ["home", "work"], "additionalProperties": False}),
    ("a book, its subtitle optional", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "subtitle": {"type": "string", "maxLength": 40},
        "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title", "pages"], "additionalProperties": False}),
    ("a product code", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
                        "required": ["code"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60}, "station": {"type": "string", "maxLength": 20}},
        "required": ["celsius", "station"], "additionalProperties": False}),
    ("a percentage", {"type": "object", "properties": {"percent": {"type": "integer", "exclusiveMinimum": 0,
                                                                   "exclusiveMaximum": 100}},
                      "required": ["percent"], "additionalProperties": False}),
    ("a list of people", {"type": "object", "properties": {"people": {
        "type": "array", "maxItems": 3, "minItems": 1, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}}},
        "required": ["people"], "additionalProperties": False}),
    ("an event with a date", {"type": "object", "properties": {"event": {"type": "string", "maxLength": 30},
                                                               "date": {"type": "string", "format": "date"}},
                              "required": ["event", "date"], "additionalProperties": False}),
    ("a username", {"type": "object", "properties": {"username": {"type": "string", "minLength": 3, "maxLength": 12,
                                                                  "pattern": "^[a-z]+$"}},
                    "required": ["username"], "additionalProperties": False}),
    ("a coordinate pair", {"type": "object", "properties": {"point": {
        "type": "array", "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90},
                                         {"type": "number", "minimum": -180, "maximum": 180}],
        "items": False, "minItems": 2}}, "required": ["point"], "additionalProperties": False}),
    ("a nullable nickname", {"type": "object", "properties": {"nickname": {"anyOf": [
        {"type": "string", "maxLength": 15}, {"type": "null"}]}}, "required": ["nickname"],
        "additionalProperties": False}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"type": "boolean"},
                                                             "reason": {"type": "string", "maxLength": 60}},
                            "required": ["answer", "reason"], "additionalProperties": False}),
    ("a recipe", {"type": "object", "properties": {
        "dish": {"type": "string", "maxLength": 30},
        "ingredients": {"type": "array", "minItems": 2, "maxItems": 4,
                        "items": {"type": "object", "properties": {
                            "item": {"type": "string", "maxLength": 20},
                            "grams": {"type": "integer", "minimum": 1, "maximum": 1000}},
                            "required": ["item", "grams"], "additionalProperties": False}}},
        "required": ["dish", "ingredients"], "additionalProperties": False}),
    ("a tree of two levels", {"$defs": {"leaf": {"type": "object", "properties": {"value": {"type": "integer"}},
                                                 "required": ["value"], "additionalProperties": False}},
                              "type": "object", "properties": {"root": {"type": "integer"}, "children": {
                                  "type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3}},
                              "required": ["root", "children"], "additionalProperties": False}),
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(embedded_artifact, tmp_path_factory):
    s = start_server(embedded_artifact, tmp_path_factory.mktemp("structured"), "--max-num-seqs", "16",
                     "--kv-cache-memory", "128M")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Give me {what} as JSON."}]


def test_every_json_schema_output_validates(client, model):
    assert len(SCHEMAS) >= 20

    def one(item):
        what, schema = item
        r = client.chat.completions.create(model=model, messages=ask(what), max_tokens=200, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": schema, "strict": True}})
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, SCHEMAS))
    unfinished = [(what, c.message.content) for (what, _), c in zip(SCHEMAS, choices) if c.finish_reason != "stop"]
    assert not unfinished
    for (what, schema), choice in zip(SCHEMAS, choices):
        # raises, naming the violation
        jsonschema.validate(json.loads(choice.message.content), schema, format_checker=jsonschema.FormatChecker())


def test_openai_parse_helper_and_json_object(client, model):
    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)

    r = client.chat.completions.parse(model=model, messages=ask("the city of Paris"), response_format=City,
                                      max_tokens=100, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message
    r = client.chat.completions.create(model=model, messages=ask("a cat"), max_tokens=100, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _check_calls(calls, allowed=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (allowed or SCHEMA_OF)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_required_tool_calls_validate_and_stream_to_the_same_calls(client, model):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls)
    # streamed: the openai client's own stream helper assembles the deltas
    with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                        max_tokens=120, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # a named function, then the tool's result continues the conversation
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    call_choice = r.choices[0]
    assert call_choice.finish_reason == "tool_calls" and len(call_choice.message.tool_calls) == 1
    _check_calls(call_choice.message.tool_calls, allowed={"add"})
    call = call_choice.message.tool_calls[0]
    follow = [{"role": "user", "content": "Add 2 and 3."},
              {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = client.chat.completions.create(model=model, messages=follow, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_regex_choice_grammar_and_the_completions_endpoint(server, client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A phone number?"}],
                                       max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"regex": r"\+44 [0-9]{4} [0-9]{6}"}})
    assert re.fullmatch(r"\+44 [0-9]{4} [0-9]{6}", r.choices[0].message.content)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=10, temperature=0.7, seed=3,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 6 times 7?"}],
                                       max_tokens=20, temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [0-9]{1,2}\.", r.choices[0].message.content)
    lark = 'start: "colour: " COLOUR\nCOLOUR: "red" | "blue"'
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a colour."}],
                                       max_tokens=20, temperature=0, extra_body={"structured_outputs": {"grammar": lark}})
    assert r.choices[0].message.content in ("colour: red", "colour: blue")
    schema = SCHEMAS[0][1]
    r = client.completions.create(model=model, prompt="A person, as JSON: ", max_tokens=60, temperature=0,
                                  extra_body={"guided_json": schema})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    metrics = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    for kind in ("regex", "choice", "grammar", "json"):
        assert metrics['infer:constrained_requests_total{kind="%s",model_name="%s"}' % (kind, model)] >= 1


def test_a_constrained_answer_cut_by_max_tokens_says_length(client, model):
    r = client.chat.completions.create(model=model, messages=ask("a recipe"), max_tokens=4, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "r", "schema": SCHEMAS[19][1]}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_logit_bias_and_allowed_token_ids(client, model):
    ids = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize", json={"prompt": " banana"}).json()["tokens"]
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                  logit_bias={str(ids[0]): 100}, logprobs=0)
    assert r.choices[0].text == (" banana" * 5 if len(ids) == 1 else r.choices[0].text)
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1,
                                  extra_body={"allowed_token_ids": [ids[0], 13]})
    tokens = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                        json={"prompt": r.choices[0].text}).json()["tokens"]
    assert set(tokens) <= {ids[0], 13}, tokens


def test_allowed_token_ids_that_the_grammar_forbids_are_a_400_not_a_server_error(server, client, model):
    """The schemathesis case: a JSON grammar beside allowed_token_ids=[0] (a token JSON never starts with)
    leaves no token to choose. That is the request's own doing: a 400 naming the fix (in-band when
    streaming), never a 500, and the server answers the next request as before."""
    body = {"model": model, "prompt": "0", "max_tokens": 8, "allowed_token_ids": [0],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
    expected = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "no_allowed_token", err
    assert "allow at least one token" in err["message"], err
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events and events[-1]["error"]["type"] == "invalid_request_error", events
    again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert again.choices[0].text == expected.choices[0].text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "allOf": [{"type": "object"}, {"required": ["a"]}]}}}}, "response_format", "'allOf'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", '"fly"'),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "does not compile"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
]


def test_each_bad_constraint_is_a_400_and_a_request_in_flight_goes_on(server, client, model):
    body = {"model": model, "messages": ask("a person"), "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0][1]}}}
    expected = client.chat.completions.create(**body).choices[0].message.content
    streamed, failures = [], []

    def stream():
        try:
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                              timeout=300) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"]
                        streamed.extend(c["delta"].get("content") or "" for c in delta)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    t = threading.Thread(target=stream)
    t.start()
    for extra, param, says in BAD:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": model, "messages": ask("anything"), "max_tokens": 5, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], (extra, err)
    t.join(300)
    assert not failures and "".join(streamed) == expected


# ---------------------------------------------------------------------------------- without a server
def test_tool_call_parsers_and_the_streamed_content_cut():
    from infer.runtime.serving.tool_calls import content_before_marker, parse_hermes, parse_llama3_json

    content, calls = parse_hermes('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                       '{"name": "add", "parameters": {"a": 3, "b": 4}}')
    assert content is None and [json.loads(c["function"]["arguments"])["a"] for c in calls] == [1, 3]
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    assert content_before_marker("Hello <tool", "<tool_call>") == "Hello "
    assert content_before_marker("Hello <tool_call>{", "<tool_call>") == "Hello "
    assert content_before_marker("Hello", "<tool_call>") == "Hello"


def test_the_chatml_tool_template_renders_tools_calls_and_results(embedded_artifact):
    from infer.runtime.engine.tokenizer import Tokenizer
    from infer.runtime.serving.tool_calls import ToolSupport

    tok = Tokenizer(embedded_artifact)
    support = ToolSupport.for_template(tok.chat_template)
    assert support is not None and support.template is not None and support.format.name == "hermes"
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "5"}],
        tools=TOOLS, template=support.template)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and text.count("<|im_start|>system") == 1
    assert json.dumps(TOOLS[1], ensure_ascii=False) in text
    content, calls = support.format.parse(text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_matcher_rolls_back_to_the_same_mask(embedded_artifact):
    """The seam speculative decoding needs: drafted tokens accepted, then taken back, leave the matcher
    where it was."""
    from infer.runtime.engine.structured import Constraint, Grammars, StructuredOutput
    from infer.runtime.engine.tokenizer import Tokenizer

    tok = Tokenizer(embedded_artifact)
    grammars = Grammars(embedded_artifact / "tokenizer.json", 49152, list(tok.eos_token_ids))
    so = grammars.compile(StructuredOutput("json", SCHEMAS[0][1]))
    c = Constraint(so.compiled, 49152)
    c.fill(0)
    start = c.bitmask.clone()
    draft = tok.encode('{"name": "Ada"')
    assert all(c.accept(t) for t in draft)
    c.fill(len(draft))
    assert not c.bitmask.equal(start)
    c.rollback(len(draft))
    c.fill(0)
    assert c.bitmask.equal(start)
    assert not c.accept(tok.encode("hello")[0])  # a token the schema forbids at the start is refused
