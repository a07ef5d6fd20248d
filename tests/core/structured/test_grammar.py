"""Constraints to grammars: StructuredOutputs' checks, llguidance compiling the schema table, the
keywords it refuses by name, choice literals, the compile cache."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from plinth.bench.schemas import SCHEMAS, UNENFORCEABLE, SchemaCase
from plinth.model.loader import load_tokenizer, resolve_model
from plinth.model.tokenizer import Tokenizer
from plinth.sampling_params import SamplingParams, StructuredOutputs
from plinth.structured.grammar import GrammarCompiler, UnsupportedConstraint
from plinth.validation import InvalidParameter


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model(None))  # SmolLM2's 49k byte-level BPE, from its GGUF


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _allowed(compiler: GrammarCompiler, matcher: Any, token: int) -> bool:
    bitmask = torch.zeros(1, -(-compiler.vocab_size // 32), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _walk(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputs, text: str) -> bool:
    """True when every token of ``text`` is allowed in turn and the grammar may end after it."""
    matcher = compiler.matcher(compiler.compile(spec))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not _allowed(compiler, matcher, token) or not matcher.consume_token(token):
            return False
    return _allowed(compiler, matcher, tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("case", SCHEMAS, ids=lambda c: c.name)
def test_every_schema_of_the_table_admits_its_instance(
    compiler: GrammarCompiler, tokenizer: Tokenizer, case: SchemaCase
) -> None:
    compact = json.dumps(case.instance, separators=(", ", ": "))  # the "compact" layout plinth enforces
    assert _walk(compiler, tokenizer, StructuredOutputs(json=case.schema), compact)
    flexible = json.dumps(case.instance, indent=2)
    assert _walk(compiler, tokenizer, StructuredOutputs(json=case.schema, whitespace="flexible"), flexible)


def test_compact_json_refuses_newlines_and_schema_violations(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    person = SCHEMAS[0]
    assert not _walk(compiler, tokenizer, StructuredOutputs(json=person.schema), json.dumps(person.instance, indent=2))
    assert not _walk(compiler, tokenizer, StructuredOutputs(json=person.schema), '{"name": "Ada", "age": -3}')
    assert not _walk(compiler, tokenizer, StructuredOutputs(json=person.schema), '{"name": "Ada"}')
    assert _walk(compiler, tokenizer, StructuredOutputs(json_object=True), '{"any": [1, 2]}')
    assert not _walk(compiler, tokenizer, StructuredOutputs(json_object=True), "[1, 2]")


@pytest.mark.parametrize("keyword", sorted(UNENFORCEABLE))
def test_unenforceable_keywords_are_refused_by_name(compiler: GrammarCompiler, keyword: str) -> None:
    with pytest.raises(UnsupportedConstraint, match=keyword) as info:
        compiler.compile(StructuredOutputs(json=UNENFORCEABLE[keyword]))
    assert info.value.field == "json"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputs(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
        (StructuredOutputs(json={"type": "strin"}), "strin"),
        (StructuredOutputs(regex="[a-"), "unclosed character class"),
        (StructuredOutputs(grammar="start: missing"), "missing"),
    ],
)
def test_invalid_constraints_name_what_is_wrong(compiler: GrammarCompiler, spec: StructuredOutputs, words: str) -> None:
    with pytest.raises(UnsupportedConstraint, match=words):
        compiler.compile(spec)


def test_choice_literals_are_escaped(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "yes"]
    spec = StructuredOutputs(choice=choices)
    for choice in choices:
        assert _walk(compiler, tokenizer, spec, choice), choice
    for other in ("no", "say hi", "yes!", "ye"):
        assert not _walk(compiler, tokenizer, spec, other), other


def test_regex_and_lark_grammars(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    date = StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}")
    assert _walk(compiler, tokenizer, date, "2026-12-02")
    assert not _walk(compiler, tokenizer, date, "2026-12-2")
    lark = StructuredOutputs(grammar='start: expr\nexpr: NUMBER | expr "+" expr\nNUMBER: /[0-9]+/')
    assert _walk(compiler, tokenizer, lark, "1+22+333")
    assert not _walk(compiler, tokenizer, lark, "1++2")


def test_compiled_grammars_are_cached_by_value(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    first = compiler.compile(StructuredOutputs(json=schema))
    assert compiler.compile(StructuredOutputs(json=json.dumps(schema))) is first  # the text form too
    assert compiler.compile(StructuredOutputs(json=schema, whitespace="flexible")) is not first


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "json"),
        ({"json": {}, "regex": "a"}, "regex"),
        ({"json": "{not json"}, "json"),
        ({"json": [1]}, "json"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"choice": "ab"}, "choice"),
        ({"regex": ""}, "regex"),
        ({"grammar": 3}, "grammar"),
        ({"json_object": 1}, "json_object"),
        ({"json": {}, "whitespace": "pretty"}, "whitespace"),
    ],
)
def test_structured_outputs_checks_its_fields(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        StructuredOutputs(**kwargs)
    assert info.value.field == field


def test_sampling_params_takes_only_a_structured_outputs() -> None:
    with pytest.raises(InvalidParameter, match="structured"):
        SamplingParams(structured={"json": {}})  # type: ignore[arg-type]
    params = SamplingParams(structured=StructuredOutputs(json={}))
    assert params.changes_logits and params.structured is not None and params.structured.kind == "json"
