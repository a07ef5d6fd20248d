"""Constraints to grammars: :class:`~plinth.sampling_params.StructuredOutputs` compiled by llguidance.

llguidance was chosen over xgrammar by measurement (``plinth bench structured``, docs/serving.md):
both enforce every schema of :data:`plinth.bench.schemas.SCHEMAS`; xgrammar's masks are cheaper per
token, but it accepts keywords it does not enforce (``uniqueItems``, ``not``, ``if``) and answers
unconstrained there, where llguidance refuses them by name, which is the contract a request gets
here. llguidance has no dependencies (xgrammar pulls torch, transformers and triton), compiles a
schema in about a millisecond (lazily), and its masks for a batch are computed off the GIL.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from plinth.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

    from plinth.model.tokenizer import Tokenizer

#: compiled grammars kept per engine (the same schema sent again is not compiled again)
_CACHE_SIZE = 256

#: JSON layout per ``StructuredOutputs.whitespace``: llguidance's compile options
_JSON_OPTIONS: dict[str, Any] = {
    "compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": {"whitespace_flexible": True},
}


class UnsupportedConstraint(ValueError):
    """A constraint that cannot be enforced: bad syntax, or a keyword the grammar library lacks.

    ``field`` names the :class:`StructuredOutputs` field ("json", "regex", ...) at fault.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"structured output {field}: {problem}")
        self.field = field
        self.problem = problem


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON or Lark text) of ``spec``, not yet checked."""
    import llguidance

    options = _JSON_OPTIONS[spec.whitespace]  # a JsonCompileOptions dict
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(c) for c in spec.choice))
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; makes matchers for them.

    Building llguidance's tokenizer tables takes ~0.3 s (SmolLM2's 49k vocabulary), so an engine
    makes its compiler at the first constrained request, not at start-up.

    :param tokenizer: the model's tokenizer (its ``tokenizers`` backend is read as JSON).
    :param vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self.tokenizer: llguidance.LLTokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=self.eos_token_ids or None
        )
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # the server adds requests from its engine thread only; tools may not

    def compile(self, spec: StructuredOutputs) -> str:
        """The checked grammar of ``spec`` (cached by :meth:`StructuredOutputs.key`).

        :raises UnsupportedConstraint: the schema, regex or grammar is invalid or uses something the
            library cannot enforce; the message is llguidance's (it names unimplemented keywords).
        """
        key = spec.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        try:
            grammar = grammar_source(spec)
        except ValueError as exc:
            raise UnsupportedConstraint(spec.kind, str(exc)) from None
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise UnsupportedConstraint(spec.kind, _one_line(messages[0]))
        if messages:  # e.g. an unknown string "format": refused rather than left unchecked
            raise UnsupportedConstraint(spec.kind, "; ".join(_one_line(m) for m in messages))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``grammar`` (from :meth:`compile`)."""
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():  # compile() validated it: only a resource limit gets here
            raise UnsupportedConstraint("grammar", _one_line(matcher.get_error()))
        return matcher


def _one_line(message: str) -> str:
    """llguidance's message on one line, without its source excerpts (``1 | ...`` and caret lines)."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not _EXCERPT.match(line)]
    return " ".join(kept) or "rejected by the grammar library"


_EXCERPT = re.compile(r"^(\d+ \||[\^~ ]+$)")
