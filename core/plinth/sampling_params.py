"""Sampling parameters: checked field by field, so bad input gets a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from plinth.validation import InvalidParameter, check_bool, check_float, check_int, check_list

#: The most logprobs a request may ask for per token.
MAX_LOGPROBS = 20


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
    - ``logit_bias``: token id -> a bias in [-100, 100] added to its logit before sampling (after
      the penalties; -100 in effect bans a token, +100 all but forces it), as OpenAI's
      ``logit_bias``. Logprobs stay those of the model's own distribution. Ids outside the
      vocabulary are refused when the request is added.

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
    logit_bias: dict[int, float] | None = None
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
            "skip_special_tokens": check_bool(owner, "skip_special_tokens", self.skip_special_tokens),
            "logit_bias": _check_logit_bias(owner, self.logit_bias),
        }
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
        """True when penalties or a logit bias rewrite this request's logits before sampling."""
        return self.has_penalties or bool(self.logit_bias)

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
