"""The FastAPI application: shared state, authentication, and the small routes (models, health,
version, metrics, tokenize, detokenize). Generation routes live in ``openai_api`` and ``anthropic_api``.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

import plinth
from plinth.server.async_engine import AsyncEngine
from plinth.server.errors import APIError, install_error_handlers
from plinth.server.metrics import ServerMetrics
from plinth.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


class ServerSettings(BaseModel):
    """What ``plinth serve`` decides about the HTTP side (the engine has its own config)."""

    served_model_names: list[str] = Field(..., min_length=1, description="names clients may ask for; first is main")
    model_root: str = Field("", description="where the model came from (shown by /v1/models)")
    api_key: str | None = Field(None, description="required as 'Authorization: Bearer KEY' on /v1 routes")
    max_output_tokens: int | None = Field(None, ge=1, description="clamp every request's max_tokens to this")


@dataclass
class ServerState:
    """Everything a route needs, hung on ``app.state.plinth``."""

    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        tokenizer = self.engine.engine.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe for encode/decode)."""
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length."""
        return self.engine.engine.max_model_len

    def model_name(self, requested: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        names = self.settings.served_model_names
        if not requested:
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {names}", param="model")
        return requested

    def max_tokens(self, requested: int | None) -> int | None:
        """``requested`` clamped to the server's ``max_output_tokens`` (the default when None)."""
        cap = self.settings.max_output_tokens
        if cap is None:
            return requested
        return cap if requested is None else min(requested, cap)

    def check_n(self, n: int) -> None:
        """400 when ``n`` exceeds the sequences the engine runs at once."""
        limit = self.engine.engine.config.max_num_seqs
        if n > limit:
            raise APIError(400, f"n={n} exceeds this server's max_num_seqs={limit}", param="n")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 when a token id is outside the vocabulary."""
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param=param)


def get_state(request: Request) -> ServerState:
    """The server state of the app serving ``request``."""
    state: ServerState = request.app.state.plinth
    return state


def require_api_key(request: Request) -> None:
    """Dependency of the /v1 routes: ``Authorization: Bearer KEY`` (or ``x-api-key``), else 401."""
    key = get_state(request).settings.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not given or not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


v1 = APIRouter(dependencies=[Depends(require_api_key)])
misc = APIRouter()


@v1.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served model names."""
    st = get_state(request)
    root = st.settings.model_root
    cards = [
        ModelCard(id=n, created=st.created, root=root, max_model_len=st.max_model_len)
        for n in st.settings.served_model_names
    ]
    return ModelList(data=cards)


@misc.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop is alive, 503 otherwise."""
    alive = get_state(request).engine.is_running
    return Response(status_code=200 if alive else 503)


@misc.get("/version")
async def version() -> dict[str, str]:
    """The plinth version."""
    return {"version": plinth.__version__}


@misc.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@misc.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered with the chat template."""
    st = get_state(request)
    st.model_name(body.model)
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = st.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        ids = st.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = st.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=st.max_model_len, tokens=ids)


@misc.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids."""
    st = get_state(request)
    st.model_name(body.model)
    st.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=st.tokenizer.decode(body.tokens))


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The application serving ``engine``; the engine thread starts and stops with the app's lifespan."""
    from plinth.server.anthropic_api import router as anthropic_router
    from plinth.server.openai_api import router as openai_router

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="plinth", version=plinth.__version__, lifespan=lifespan)
    app.state.plinth = ServerState(
        engine=engine, settings=settings, metrics=ServerMetrics(lambda: engine.stats, settings.served_model_names[0])
    )
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(openai_router, dependencies=[Depends(require_api_key)])
    app.include_router(anthropic_router, dependencies=[Depends(require_api_key)])
    app.include_router(misc)
    return app
