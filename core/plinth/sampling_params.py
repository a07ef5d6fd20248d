"""Sampling parameters: checked field by field, so bad input gets a message naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from plinth.validation import InvalidParameter, check_bool, check_float, check_int, check_list

#: The most logprobs a request may ask for per token.
MAX_LOGPROBS = 20


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """A constraint on the text a request generates; exactly one kind is given.

    - ``json``: a JSON schema (a dict, or its text): the output is a JSON value that validates.
    - ``json_object``: True: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).
    - ``regex``: the output matches the regular expression as a whole (Rust ``regex`` syntax).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a Lark grammar (llguidance's dialect, ``start`` rule first); GBNF is not read.

    ``whitespace`` ("compact" or "flexible") is how JSON may be laid out: "compact" allows exactly
    ``", "`` between items and ``": "`` after keys (no newlines, so a model cannot pad forever);
    "flexible" any JSON whitespace. Which keywords of a schema can be enforced is decided when the
    request is added: a schema the grammar library cannot enforce is refused, naming the keyword.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace: str = "compact"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidParameter(owner, "json", f"is not valid JSON: {exc}") from None
        if schema is not None and not isinstance(schema, dict):
            raise InvalidParameter(owner, "json", f"must be a JSON schema (an object), got {type(schema).__name__}")
        object.__setattr__(self, "json", schema)
        object.__setattr__(self, "json_object", check_bool(owner, "json_object", self.json_object))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(owner, name, f"must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = check_list(owner, "choice", self.choice, str)
            if not choice or any(c == "" for c in choice):
                raise InvalidParameter(owner, "choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if self.whitespace not in ("compact", "flexible"):
            raise InvalidParameter(owner, "whitespace", f"must be 'compact' or 'flexible', got {self.whitespace!r}")
        given = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(
                owner,
                given[1] if len(given) > 1 else "json",
                f"give exactly one of json, json_object, regex, choice, grammar (got {', '.join(given) or 'none'})",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A string naming the constraint exactly (equal constraints, equal keys): the compile cache's key."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace], sort_keys=True)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those filters.
    Penalties follow the OpenAI definitions (presence, frequency: subtracted from the logits of
    tokens already generated) and the CTRL/Hugging Face one (repetition: divides positive and
    multiplies negative logits of tokens in the prompt or the output).

    - ``n`` (1-64): completions per prompt; they share the prompt's KV blocks.
    - ``max_tokens`` (>= 1): new tokens at most; None: up to the context length.
    - ``min_tokens`` (>= 0, <= max_tokens): stop conditions are ignored before this many tokens.
    - ``temperature`` (0-100), ``top_k`` (>= -1), ``top_p`` (0 < p <= 1), ``min_p`` (0-1).
    - ``seed`` (-2**63 <= seed < 2**64): the same seed gives the same tokens.
    - ``repetition_penalty`` (0 < r <= 10), ``presence_penalty`` and ``frequency_penalty`` (-2 to 2).
    - ``stop``: stop strings (a string or a list; not included in the text), ``stop_token_ids``.
    - ``logprobs`` (0-:data:`MAX_LOGPROBS`): top-n logprobs per token.
    - ``prompt_logprobs`` (0-:data:`MAX_LOGPROBS`): the logprob of every prompt token after the
      first (given the tokens before it) and the top-n alternatives at its position, as vLLM's
      ``prompt_logprobs``; ``RequestOutput.prompt_logprobs`` holds them, ``None`` first. Such a
      request takes no prefix-cache hits (every prompt position is computed).
    - ``logit_bias``: token id -> a bias in [-100, 100] added to its logit before sampling (after
      the penalties; -100 in effect bans a token, +100 all but forces it), as OpenAI's
      ``logit_bias``. Logprobs stay those of the model's own distribution. Ids outside the
      vocabulary are refused when the request is added.
    - ``structured``: a :class:`StructuredOutputs` constraint (JSON schema, regex, choice,
      grammar): each step only the tokens that keep the output valid may be sampled, and the
      sequence ends as soon as the constraint is complete. Logprobs stay the model's own.

    A value of the wrong type or out of range raises :class:`~plinth.validation.InvalidParameter`
    naming the field; an unknown keyword raises ``TypeError``.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutputs | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        owner = type(self).__name__
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        stop = check_list(owner, "stop", stop, str)
        if any(s == "" for s in stop):
            raise InvalidParameter(owner, "stop", "stop strings must not be empty")
        top_k = check_int(owner, "top_k", self.top_k, ge=-1)
        checked = {
            "n": check_int(owner, "n", self.n, ge=1, le=64),
            "max_tokens": check_int(owner, "max_tokens", self.max_tokens, optional=True, ge=1),
            "min_tokens": check_int(owner, "min_tokens", self.min_tokens, ge=0),
            "temperature": check_float(owner, "temperature", self.temperature, ge=0.0, le=100.0),
            "top_k": 0 if top_k == -1 else top_k,
            "top_p": check_float(owner, "top_p", self.top_p, gt=0.0, le=1.0),
            "min_p": check_float(owner, "min_p", self.min_p, ge=0.0, le=1.0),
            "seed": check_int(owner, "seed", self.seed, optional=True, ge=-(2**63), lt=2**64),
            "repetition_penalty": check_float(owner, "repetition_penalty", self.repetition_penalty, gt=0.0, le=10.0),
            "presence_penalty": check_float(owner, "presence_penalty", self.presence_penalty, ge=-2.0, le=2.0),
            "frequency_penalty": check_float(owner, "frequency_penalty", self.frequency_penalty, ge=-2.0, le=2.0),
            "stop": stop,
            "stop_token_ids": check_list(owner, "stop_token_ids", self.stop_token_ids, int),
            "include_stop_str_in_output": check_bool(
                owner, "include_stop_str_in_output", self.include_stop_str_in_output
            ),
            "ignore_eos": check_bool(owner, "ignore_eos", self.ignore_eos),
            "logprobs": check_int(owner, "logprobs", self.logprobs, optional=True, ge=0, le=MAX_LOGPROBS),
            "prompt_logprobs": check_int(
                owner, "prompt_logprobs", self.prompt_logprobs, optional=True, ge=0, le=MAX_LOGPROBS
            ),
            "skip_special_tokens": check_bool(owner, "skip_special_tokens", self.skip_special_tokens),
            "logit_bias": _check_logit_bias(owner, self.logit_bias),
        }
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise InvalidParameter(
                owner, "structured", f"must be a StructuredOutputs, got {type(self.structured).__name__}"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                owner, "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """True when penalties, a logit bias or a structured-output mask rewrite this request's
        logits before sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.structured is not None

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


#: The largest |bias| ``logit_bias`` takes (OpenAI's range).
MAX_LOGIT_BIAS = 100.0


def _check_logit_bias(owner: str, value: object) -> dict[int, float] | None:
    """``value`` as a new ``{token id: bias}`` dict (None or empty: None); ids >= 0, biases finite in
    [-:data:`MAX_LOGIT_BIAS`, :data:`MAX_LOGIT_BIAS`]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter(owner, "logit_bias", f"must be a dict of token id -> bias, got {value!r}")
    checked: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise InvalidParameter(owner, "logit_bias", f"keys must be token ids (ints >= 0), got {key!r}")
        try:
            value = check_float(owner, "logit_bias", bias, ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)
        except InvalidParameter as exc:
            raise InvalidParameter(owner, "logit_bias", f"the bias of token {key} {exc.problem}") from None
        assert value is not None  # not optional: check_float returned a number
        checked[key] = value
    return checked or None
