"""What every route shares: the server's settings and state, authentication, and the request-level
checks and helpers (prompt tokenization off the event loop, the fan-out cap, the context check).

Routes (``app``, ``openai_api``, ``anthropic_api``) import this module; it imports none of them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel, Field

from plinth.model.tokenizer import InvalidText
from plinth.pooling_params import PoolingParams
from plinth.runtime.outputs import RequestOutput
from plinth.sampling_params import SamplingParams, StructuredOutputs
from plinth.server import DEFAULT_MAX_REQUEST_BYTES
from plinth.server.async_engine import AsyncEngine
from plinth.server.errors import APIError
from plinth.server.metrics import ServerMetrics
from plinth.structured.grammar import UnsupportedConstraint

#: a string prompt longer than this many characters per context token is tokenized prefix-first:
#: when the prefix alone overflows the context, the rest is never tokenized (English averages ~4)
_CHARS_PER_TOKEN_BOUND = 16


class ServerSettings(BaseModel):
    """What ``plinth serve`` decides about the HTTP side (the engine has its own config)."""

    served_model_names: list[str] = Field(..., min_length=1, description="names clients may ask for; first is main")
    api_key: str | None = Field(None, description="required as 'Authorization: Bearer KEY' on every route but /health")
    max_output_tokens: int | None = Field(None, ge=1, description="clamp every request's max_tokens to this")
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1024, description="larger bodies get a 413")
    max_request_sequences: int | None = Field(
        None, ge=1, description="prompts x n of one request at most (None: the engine's max_num_seqs)"
    )
    public_metrics: bool = Field(False, description="serve /metrics without the API key (for scrapers)")
    enable_docs: bool = Field(False, description="serve /docs (Swagger UI, loads its assets from a CDN)")
    vllm_metric_names: bool = Field(True, description="also export every metric under vLLM's 'vllm:' names")


@dataclass
class ServerState:
    """Everything a route needs, hung on ``app.state.plinth``.

    ``draining`` and ``in_flight`` belong to the shutdown (:mod:`plinth.server.drain`): the request
    gate refuses new requests while draining and counts the ones it let in.
    """

    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    #: the LoRA adapters clients may name as ``model`` (in load order), kept by the admin routes
    #: (:mod:`plinth.server.lora_api`) in step with the engine's
    loras: list[str] = field(default_factory=list)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe for encode/decode)."""
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length."""
        return self.engine.engine.max_model_len

    @property
    def max_request_sequences(self) -> int:
        """The fan-out cap: prompts x n of one request."""
        return self.settings.max_request_sequences or self.engine.engine.config.max_num_seqs

    def model_name(self, requested: str | None, adapters: bool = True) -> str:
        """The served name to answer with (a LoRA adapter's name too, unless ``adapters`` is False);
        404 for a model this server does not serve."""
        names = self.settings.served_model_names
        if not requested:
            return names[0]
        if requested in names or (adapters and requested in self.loras):
            return requested
        served = names + self.loras if adapters else names
        if requested in self.loras:
            raise APIError(400, f"the model {requested!r} is a LoRA adapter: this route serves {names}", param="model")
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served}", param="model")

    def lora_for(self, model: str) -> str | None:
        """The LoRA adapter a request for served name ``model`` runs with (None: the base model)."""
        return model if model in self.loras and model not in self.settings.served_model_names else None

    def max_tokens(self, requested: int | None) -> int | None:
        """``requested`` clamped to the server's ``max_output_tokens`` (the default when None)."""
        cap = self.settings.max_output_tokens
        if cap is None:
            return requested
        return cap if requested is None else min(requested, cap)

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """400 when one request would make more sequences (prompts x n) than the server allows.

        Checked before anything is tokenized or queued: 256 prompts x n=64 would otherwise be
        16,384 sequences from one request while every other client waits.
        """
        limit = self.max_request_sequences
        if num_prompts * n > limit:
            what = f"{num_prompts} prompts x n={n} = {num_prompts * n}" if num_prompts > 1 else f"n={n}"
            raise APIError(400, f"{what} sequences exceed this server's limit of {limit} per request", param="n")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 when a token id is outside the vocabulary."""
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param=param)

    async def check_structured(self, spec: StructuredOutputs, param: str) -> None:
        """400 naming ``param`` when the constraint cannot be enforced (a bad schema, regex or
        grammar, or a keyword the grammar library lacks). Compiled off the event loop, into the
        cache the engine reads when the request is added."""
        structured = self.engine.engine.structured
        try:
            await asyncio.to_thread(lambda: structured.compiler.compile(spec))
        except UnsupportedConstraint as exc:
            raise APIError(400, f"{param}: {exc.problem}", param=param) from None

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, param: str, max_tokens_param: str) -> None:
        """400 when the prompt leaves no room for output, or prompt + ``max_tokens`` exceeds the context
        (OpenAI and vLLM refuse rather than clamp)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"the prompt has {num_prompt_tokens} tokens; this model's context length is {limit} "
                "(at least one token must remain for the output)",
                param=param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed this model's "
                f"context length of {limit}; ask for at most {limit - num_prompt_tokens}",
                param=max_tokens_param,
            )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, tokenized off the event loop; a 400 naming ``param`` when the
        prompt is over the context, found from a prefix when the text is far longer than it."""
        tokenizer = self.tokenizer
        bound = self.max_model_len * _CHARS_PER_TOKEN_BOUND
        try:
            if len(text) > bound:
                head: list[int] = await asyncio.to_thread(tokenizer.encode, text[:bound], add_special_tokens)
                if len(head) >= self.max_model_len:
                    raise APIError(
                        400,
                        f"the prompt ({len(text)} characters) has more tokens than this model's context length "
                        f"of {self.max_model_len}",
                        param=param,
                    )
            ids: list[int] = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
        except InvalidText as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None
        return ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, decoded off the event loop."""
        text: str = await asyncio.to_thread(self.tokenizer.decode, ids, skip_special_tokens)
        return text

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        param: str = "messages",
        add_generation_prompt: bool = True,
        template_vars: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render ``messages`` with the chat template and tokenize them, both off the event loop;
        ``template_vars``: extra template variables (``tools``)."""
        text: str = await asyncio.to_thread(
            lambda: self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **(template_vars or {})
            )
        )
        return await self.encode(text, param, add_special_tokens=False)


def get_state(request: Request) -> ServerState:
    """The server state of the app serving ``request``."""
    state: ServerState = request.app.state.plinth
    return state


def check_api_key(state: ServerState, authorization: str, x_api_key: str) -> bool:
    """True when the server needs no key or the request carries it (``Bearer`` or ``x-api-key``)."""
    key = state.settings.api_key
    if key is None:
        return True
    scheme, _, token = authorization.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else x_api_key
    return bool(given) and secrets.compare_digest(given.encode(), key.encode())


def require_api_key(request: Request) -> None:
    """Dependency of the protected routes: ``Authorization: Bearer KEY`` (or ``x-api-key``), else 401."""
    headers = request.headers
    if not check_api_key(get_state(request), headers.get("authorization", ""), headers.get("x-api-key", "")):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


async def engine_outputs(
    st: ServerState,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams | PoolingParams,
    lora: str | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs for one request (with LoRA adapter ``lora``), observed by the metrics;
    closing it aborts the request."""
    tracker = st.metrics.tracker()
    stream = st.engine.generate(request_id, prompt, params, lora)
    try:
        async for out in stream:
            tracker.observe(out)
            yield out
    finally:
        tracker.close()
        await stream.aclose()
