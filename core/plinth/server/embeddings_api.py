"""``POST /v1/embeddings``: OpenAI's embeddings API on the served decoder model.

Each input is one engine embedding request (batched continuously with whatever else runs); the
answer lists them in input order. ``encoding_format: "base64"`` (what the ``openai`` client asks for
by default) is the base64 of the little-endian float32 values. plinth's extras are top-level fields
(the client's ``extra_body``): ``pooling`` (``"last"``, the default, or ``"mean"``) and ``normalize``.
``dimensions`` other than the hidden size needs a model whose config declares Matryoshka dimensions
(see :mod:`plinth.runtime.embeddings`); else it is a 400 naming ``dimensions``.
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from plinth.pooling_params import PoolingParams
from plinth.runtime.embeddings import check_dimensions
from plinth.runtime.engine import InvalidRequest
from plinth.server.errors import APIError
from plinth.server.openapi import ERRORS
from plinth.server.protocol import Bool, Int, Text
from plinth.server.state import engine_outputs, get_state
from plinth.server.streams import ClientDisconnected, Streams, collect

router = APIRouter()

#: inputs in one request at most (OpenAI's limit)
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one input or a batch (strings, token ids, or lists of token ids).

    Unknown fields are refused (a 400 naming them), as on every plinth request.
    """

    model_config = ConfigDict(extra="forbid")

    input: Text | list[Text] | list[Int] | list[list[Int]] = Field(..., description="one input or a batch")
    model: Text | None = Field(None, description="a served model name; omitted: the default one")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes, base64-encoded"
    )
    dimensions: Int | None = Field(
        None, ge=1, description="only the full hidden size, unless the model declares Matryoshka dimensions"
    )
    user: Text | None = Field(None, description="accepted and ignored")
    # plinth extras (the openai client's extra_body)
    pooling: Literal["last", "mean"] = Field("last", description="the last token's hidden state, or the mean")
    normalize: Bool = Field(True, description="scale to unit L2 norm")

    def inputs(self) -> list[str | list[int]]:
        """The inputs of the batch, in order."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise APIError(400, "input must not be empty", param="input")
        if isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request, got {len(value)}", param="input")
        return list(value)  # type: ignore[arg-type]


class Embedding(BaseModel):
    """One input's vector: a list of floats, or a base64 string of little-endian float32."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """The tokens the inputs counted."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The body of a ``/v1/embeddings`` answer."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI embeddings: the final hidden states pooled (last token or mean), in float32."""
    st = get_state(request)
    model = st.model_name(body.model, adapters=False)  # adapters do not embed
    try:
        check_dimensions(st.engine.engine.model_config, body.dimensions)
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param="dimensions") from None
    params = PoolingParams(pooling=body.pooling, normalize=body.normalize, dimensions=body.dimensions)
    inputs = body.inputs()
    limit = st.max_model_len
    prompt_ids: list[list[int]] = []
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input.{i}"
        if isinstance(item, list):
            st.check_token_ids(item, param)
            ids = item
        elif not item:
            raise APIError(400, "an input must not be an empty string", param=param)
        else:
            ids = await st.encode(item, param)
        if not ids:
            raise APIError(400, "the input is empty", param=param)
        if len(ids) > limit:
            raise APIError(400, f"the input has {len(ids)} tokens; this model's context length is {limit}", param=param)
        prompt_ids.append(ids)
    base = f"embd-{uuid.uuid4().hex}"
    streams: Streams = {i: engine_outputs(st, f"{base}-{i}", ids, params) for i, ids in enumerate(prompt_ids)}
    try:
        finals = await collect(request, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    data: list[dict[str, Any]] = []
    for i, out in sorted(finals.items()):
        assert out.embedding is not None, "an embedding request ends with its vector"
        data.append({"object": "embedding", "index": i, "embedding": _encode(out.embedding, body.encoding_format)})
    tokens = sum(len(ids) for ids in prompt_ids)
    # a plain JSON response: the vectors are not validated once more on the way out
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
