"""The FastAPI application: the small routes (models, health, version, metrics, tokenize,
detokenize) and :func:`build_app`, which puts them together with the generation routes of
``openai_api`` and ``anthropic_api`` and the embeddings route of ``embeddings_api``, the request gate
and the error handlers.

Every route but ``/health`` and ``/version`` needs the API key when one is set (``/metrics`` too,
unless ``--public-metrics``): the tokenizer routes do real work for whoever calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

import plinth
from plinth.server.anthropic_api import router as anthropic_router
from plinth.server.async_engine import AsyncEngine
from plinth.server.embeddings_api import router as embeddings_router
from plinth.server.errors import install_error_handlers
from plinth.server.gate import RequestGate
from plinth.server.lora_api import router as lora_router
from plinth.server.metrics import ServerMetrics
from plinth.server.openai_api import router as openai_router
from plinth.server.openapi import ERRORS, describe
from plinth.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from plinth.server.state import ServerSettings, ServerState, get_state, require_api_key

__all__ = ["ServerSettings", "ServerState", "build_app"]

protected = APIRouter(dependencies=[Depends(require_api_key)])
public = APIRouter()


def _card(st: ServerState, name: str) -> ModelCard:
    # root is the served name, never the model's (or an adapter's) path (which tells a caller about the host)
    parent = st.settings.served_model_names[0] if st.lora_for(name) is not None else None
    return ModelCard(id=name, created=st.created, root=name, max_model_len=st.max_model_len, parent=parent)


@protected.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    """The served model names, then the LoRA adapters (each with its ``parent``)."""
    st = get_state(request)
    return ModelList(data=[_card(st, n) for n in [*st.settings.served_model_names, *st.loras]])


@protected.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """One served model; 404 for a name this server does not serve."""
    st = get_state(request)
    return _card(st, st.model_name(model_id))


@public.get("/health", responses={200: {"description": "serving"}, 503: {"description": "draining or stopped"}})
async def health(request: Request) -> Response:
    """200 while the engine loop is alive and the server is not draining, 503 otherwise."""
    st = get_state(request)
    return Response(status_code=200 if st.engine.is_running and not st.draining else 503)


@public.get("/version")
async def version() -> dict[str, str]:
    """The plinth version."""
    return {"version": plinth.__version__}


async def _metrics_access(request: Request) -> None:
    if not get_state(request).settings.public_metrics:
        require_api_key(request)


@public.get(
    "/metrics",
    dependencies=[Depends(_metrics_access)],
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}, **ERRORS},
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (behind the API key unless ``--public-metrics``)."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@protected.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered with the chat template."""
    st = get_state(request)
    st.model_name(body.model)
    if body.messages is not None:
        messages = [m.template_message() for m in body.messages]
        ids = await st.chat_prompt(messages, "messages", body.add_generation_prompt)
    else:
        ids = await st.encode(body.prompt or "", "prompt", body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=st.max_model_len, tokens=ids)


@protected.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids."""
    st = get_state(request)
    st.model_name(body.model)
    st.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await st.decode(body.tokens))


def build_app(engine: AsyncEngine, settings: ServerSettings, on_start: Any = None) -> FastAPI:
    """The application serving ``engine``; the engine thread starts and stops with the app's lifespan.

    :param on_start: called with the running loop once the engine started (``plinth serve``
        binds its shutdown drain there).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        if on_start is not None:
            import asyncio

            on_start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await engine.shutdown()

    docs = settings.enable_docs
    app = FastAPI(
        title="plinth",
        version=plinth.__version__,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
    )
    metrics = ServerMetrics(lambda: engine.stats, settings.served_model_names[0], vllm_names=settings.vllm_metric_names)
    # the adapters loaded at start-up (--lora); the admin routes keep the list after that
    state = ServerState(engine=engine, settings=settings, metrics=metrics, loras=engine.engine.list_loras())
    app.state.plinth = state
    install_error_handlers(app)
    app.include_router(protected)
    app.include_router(openai_router, dependencies=[Depends(require_api_key)])
    app.include_router(embeddings_router, dependencies=[Depends(require_api_key)])
    app.include_router(anthropic_router, dependencies=[Depends(require_api_key)])
    app.include_router(lora_router, dependencies=[Depends(require_api_key)])
    app.include_router(public)
    app.add_middleware(RequestGate, state=lambda: state)
    describe(app)
    return app
