"""The offline API's argument handling: vLLM's prompt forms are taken, misuse gets an error naming the
argument and what was expected, and an interrupted call leaves the engine ready for the next one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plinth import LLM, SamplingParams
from plinth.runtime.engine import InvalidRequest

sys.path.insert(0, str(Path(__file__).parent / "runtime" / "engine"))
from engine_helpers import save_tiny_folder  # noqa: E402 - a helper module beside the engine's tests

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT_FORMS = 'a str, a list of token ids (ints), {"prompt": str} or {"prompt_token_ids": [int, ...]}'


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", folder)
    return LLM(model=str(folder), backend="cpu", num_kv_blocks=64, block_size=16)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_vllm_prompt_forms_generate_what_the_plain_forms_do(llm: LLM) -> None:
    ids = llm.tokenizer.encode("hello world")
    plain = _tokens(llm.generate(["hello world", ids], GREEDY))
    assert _tokens(llm.generate({"prompt": "hello world"}, GREEDY)) == plain[:1]
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain[1:]
    assert _tokens(llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": ids}], GREEDY)) == plain
    assert _tokens(llm.generate(tuple(ids), GREEDY)) == plain[1:]  # a tuple of ids is one prompt
    assert _tokens(llm.generate([np.int64(t) for t in ids], GREEDY)) == plain[1:]  # numpy's integers are ids
    [out] = llm.generate({"prompt": "hello world"}, GREEDY)
    assert out.prompt == "hello world" and out.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        (None, TypeError, f"prompts must be {PROMPT_FORMS}, or a list of these; got None"),
        (5, TypeError, "got 5 (int)"),
        (b"Hi", TypeError, "got b'Hi' (bytes; decode it to a str first)"),
        (np.array([1, 2, 3]), TypeError, "(numpy.ndarray; convert an array of token ids with .tolist())"),
        (["hi", None], TypeError, f"prompts[1] must be {PROMPT_FORMS}; got None"),
        ([1, "two"], TypeError, "prompts[1] must be a token id (int), got 'two'"),
        ([True, False], TypeError, "prompts[0] must be"),  # a bool is an int, never a token id
        (
            {"text": "hi"},
            InvalidRequest,
            'must have exactly one key, "prompt" or "prompt_token_ids"; got keys [\'text\']',
        ),
        ({"prompt": "hi", "multi_modal_data": {}}, InvalidRequest, "plinth's models take text only"),
        ({"prompt": ["hi"]}, TypeError, "prompts[\"prompt\"] must be a str, got ['hi'] (list)"),
        ({"prompt_token_ids": "1 2"}, TypeError, 'prompts["prompt_token_ids"] must be a list of ints'),
        (
            [{"prompt_token_ids": [1, 2.5]}],
            TypeError,
            r'prompts[0]["prompt_token_ids"][1] must be a token id (int), got 2.5',
        ),
        ("\ud800", InvalidRequest, "prompts is not valid text: '\\ud800' at character 0 is a lone surrogate"),
        (
            ["ok", {"prompt": "a\udfffb"}],
            InvalidRequest,
            "prompts[1][\"prompt\"] is not valid text: '\\udfff' at character 1",
        ),
        (["ok", []], InvalidRequest, "prompts[1]: the prompt is empty"),
    ],
)
def test_misused_prompts_are_refused_naming_the_argument(llm: LLM, prompts: Any, error: type, message: str) -> None:
    with pytest.raises(error) as exc_info:
        llm.generate(prompts, GREEDY)
    assert message in str(exc_info.value)
    assert not llm.engine.has_unfinished()  # nothing of the refused call was queued


def test_misused_params_are_refused_naming_the_argument(llm: LLM) -> None:
    with pytest.raises(
        TypeError,
        match=r"params must be a SamplingParams.*got \{'max_tokens': 2\} \(dict\).*"
        r"SamplingParams\(\*\*params\)",
    ):
        llm.generate("hi", {"max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"params\[1\] must be a SamplingParams, got 'greedy'"):
        llm.generate(["a", "b"], [GREEDY, "greedy"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY])
    assert not llm.engine.has_unfinished()


def test_chat_takes_text_parts_and_names_bad_messages(llm: LLM) -> None:
    plain = _tokens(llm.chat([{"role": "user", "content": "hello there"}], GREEDY))
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert _tokens(llm.chat([{"role": "user", "content": parts}], GREEDY)) == plain
    two = llm.chat([[{"role": "user", "content": "hello there"}], [{"role": "user", "content": parts}]], GREEDY)
    assert _tokens(two) == plain * 2
    ids = llm.encode_chat([{"role": "user", "content": "hello there"}])
    assert two[0].prompt_token_ids == ids  # encode_chat counts what chat sends

    cases: list[tuple[Any, type, str]] = [
        ("hi", TypeError, "messages must be a list of messages"),
        ([{"content": "hi"}], TypeError, 'messages[0]["role"] must be a str such as "user"'),
        ([{"role": "user", "content": 7}], TypeError, 'messages[0]["content"] must be a str or a list of text parts'),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            TypeError,
            'messages[0]["content"][0] must be a text part',
        ),
        ([[{"role": "user", "content": "a"}], "b"], TypeError, "messages[1] must be a list of messages"),
        (
            [{"role": "system", "content": "ok"}, {"role": "user", "content": "x\ud800"}],
            InvalidRequest,
            "messages[1][\"content\"] is not valid text: '\\ud800' at character 1 is a lone surrogate",
        ),
        (
            [{"role": "user", "content": "hi", "name": "\udc80"}],
            InvalidRequest,
            'messages[0]["name"] is not valid text',
        ),
    ]
    for messages, error, message in cases:
        with pytest.raises(error) as exc_info:
            llm.chat(messages, GREEDY)
        assert message in str(exc_info.value), messages
    assert not llm.engine.has_unfinished()


def test_an_interrupted_step_leaves_the_engine_ready(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _tokens(llm.generate("hello world", GREEDY))
    real_execute = llm.engine.runner.execute

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
        raise KeyboardInterrupt  # Ctrl-C between schedule() and update()

    monkeypatch.setattr(llm.engine.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate("hello world", GREEDY)
    assert not llm.engine.has_unfinished()
    assert _tokens(llm.generate("hello world", GREEDY)) == expected  # the half-done step was forgotten


def test_on_output_raising_aborts_the_call(llm: LLM) -> None:
    def stop(out: Any) -> None:
        raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        llm.generate(["a", "b"], GREEDY, on_output=stop)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(["a", "b"], GREEDY)) == 2
