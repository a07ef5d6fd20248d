"""plinth.tools: tools into the prompt (templates that render them and those that do not), the grammar
of required and named calls, and calls parsed out of whole and streamed replies."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from plinth.model.loader import load_tokenizer, resolve_model
from plinth.sampling_params import StructuredOutputs
from plinth.structured.grammar import GrammarCompiler
from plinth.tools import CALL_OPEN, Tool, ToolCallStream, block, call_constraint, chat_messages, parse_tool_calls

WEATHER = Tool(
    "get_weather",
    "The weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
)
NOW = Tool("now")
TOOLS = [WEATHER, NOW]


def test_parse_splits_text_and_calls() -> None:
    text = f"Let me check.\n{block('get_weather', {'city': 'Oslo'})}\n{block('now', '{}')}"
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "bad",
    [
        f"{CALL_OPEN}not json</tool_call>",
        f'{CALL_OPEN}{{"name": "unknown", "arguments": {{}}}}</tool_call>',
        f'{CALL_OPEN}{{"name": "now", "arguments": [1]}}</tool_call>',
        "no calls at all",
    ],
)
def test_what_is_not_a_call_stays_text(bad: str) -> None:
    assert parse_tool_calls(bad, TOOLS) == (bad, [])


def test_other_argument_spellings_and_a_cut_block() -> None:
    _, calls = parse_tool_calls(f'{CALL_OPEN}{{"name": "now", "parameters": {{"tz": "UTC"}}}}', TOOLS)  # unclosed
    assert [(c.name, c.arguments) for c in calls] == [("now", '{"tz": "UTC"}')]
    _, calls = parse_tool_calls(f'{CALL_OPEN}{{"name": "now", "arguments": "{{\\"a\\": 1}}"}}</tool_call>', TOOLS)
    assert calls[0].arguments == '{"a": 1}'


def test_stream_holds_back_a_tag_and_hands_out_whole_calls() -> None:
    reply = f"Sure {block('get_weather', {'city': 'Rome'})} and <b>bold</b> <tool_cal"
    stream = ToolCallStream(TOOLS)
    texts, calls = [], []
    for i in range(0, len(reply), 3):  # three characters at a time
        text, made = stream.feed(reply[i : i + 3])
        texts.append(text)
        calls += made
        assert CALL_OPEN[:4] not in text  # never a piece of a tag
    text, made = stream.feed("", final=True)
    texts.append(text)
    calls += made
    assert "".join(texts) == "Sure  and <b>bold</b> <tool_cal"
    assert [c.name for c in calls] == ["get_weather"] and stream.num_calls == 1


def test_templates_that_render_tools_get_them_and_object_arguments() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]  # fmt: skip
    messages, variables = chat_messages(history, TOOLS, "{% for t in tools %}{{ t }}{% endfor %}")
    assert variables["tools"][0] == {"type": "function", "function": {"name": "get_weather", "parameters":
                                     WEATHER.schema, "description": "The weather"}}  # fmt: skip
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert messages[2]["role"] == "tool" and history[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'


def test_templates_without_tools_get_plinths_section_and_blocks() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]  # fmt: skip
    messages, variables = chat_messages(history, TOOLS, "{{ messages }}")
    assert variables == {}
    assert messages[0]["content"].startswith("Be brief.") and "get_weather" in messages[0]["content"]
    assert messages[1]["content"] == block("now", {})
    assert messages[2] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    assert chat_messages([{"role": "user", "content": "x"}], TOOLS, None)[0][0]["role"] == "system"


def test_history_arguments_that_are_not_json_go_in_as_text() -> None:
    """A client may send back what a model wrote, valid JSON or not (the server fuzz test found a 500
    here): plinth's block and a tool-rendering template both get the text, nothing is refused."""
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{not json"}}]}]  # fmt: skip
    messages, _ = chat_messages(history, TOOLS, "{{ messages }}")
    assert json.loads(messages[1]["content"].split("\n")[1]) == {"name": "now", "arguments": "{not json"}
    rendered, _ = chat_messages(history, TOOLS, "{% for t in tools %}{{ t }}{% endfor %}{{ messages }}")
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == "{not json"


@pytest.fixture(scope="module")
def admits() -> Callable[[StructuredOutputs, str], bool]:
    """Whether a constraint's grammar takes ``text`` whole (SmolLM2's tokenizer)."""
    tok = load_tokenizer(resolve_model(None))
    compiler = GrammarCompiler(tok, tok.vocab_size)

    def check(spec: StructuredOutputs, text: str) -> bool:
        matcher = compiler.matcher(compiler.compile(spec))
        return bool(matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting())

    return check


def test_required_and_named_call_grammars(admits: Callable[[StructuredOutputs, str], bool]) -> None:
    one, two = block("get_weather", {"city": "Oslo"}), block("now", {})
    required = call_constraint(TOOLS)
    assert admits(required, one) and admits(required, f"{one}\n{two}")
    assert not admits(required, "plain text")
    assert not admits(required, block("get_weather", {"town": "Oslo"}))  # the schema holds
    single = call_constraint(TOOLS, parallel=False)
    assert admits(single, two) and not admits(single, f"{one}\n{two}")
    named = call_constraint(TOOLS, name="now")
    assert admits(named, two) and not admits(named, one)
    with pytest.raises(ValueError, match="nope"):
        call_constraint(TOOLS, name="nope")
