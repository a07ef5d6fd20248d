"""LoRA adapters at run time: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(vLLM's routes and bodies), behind the API key like every generation route.

The engine changes its adapter slots on its own thread, between two steps
(:meth:`plinth.server.async_engine.AsyncEngine.call`); the route answers when that is done. A
refusal (a bad folder, a duplicate name, no free slot) is a 400 naming the field, an unknown name
on unload a 404; either way nothing changed and the requests in flight keep running. Unloading an
adapter that running requests use lets them finish with it (its slot frees after the last one);
new requests for it get the 404 of an unknown model at once.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from plinth.runtime.lora import LoRAError
from plinth.server.errors import APIError
from plinth.server.openapi import ERRORS
from plinth.server.state import get_state

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``: a PEFT adapter folder on the server's disk, and its name."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(..., min_length=1, description="the name clients put in 'model'")
    lora_path: str = Field(
        ..., min_length=1, description="a PEFT folder: adapter_config.json + adapter_model.safetensors"
    )


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(..., min_length=1)
    lora_int_id: int | None = Field(None, description="accepted for vLLM clients; unused")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter; 400 naming the field when it cannot be served (or LoRA is off)."""
    st = get_state(request)
    name = body.lora_name
    if name in st.settings.served_model_names:
        raise APIError(400, f"{name!r} is the base model's served name", param="lora_name")
    try:
        await st.engine.call(lambda engine: engine.add_lora(name, body.lora_path))
    except LoRAError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    st.loras.append(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Unload a LoRA adapter (requests running with it finish first); 404 for an unknown name."""
    st = get_state(request)
    name = body.lora_name
    if name not in st.loras:
        raise APIError(404, f"no LoRA adapter named {name!r} is loaded; loaded: {st.loras}", param="lora_name")
    st.loras.remove(name)  # new requests for it are refused from now on
    try:
        await st.engine.call(lambda engine: engine.remove_lora(name))
    except LoRAError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
