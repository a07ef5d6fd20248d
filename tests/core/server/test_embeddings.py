"""``/v1/embeddings`` on a real server process (a tiny random Llama): the official ``openai`` client
(base64, its default, and float) gets the vectors of a plain transformers forward; bad input is a 400
naming the field; generation running alongside keeps its greedy tokens."""

from __future__ import annotations

import asyncio
import base64
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_helpers import ServerProcess, running

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "engine"))
from engine_helpers import save_tiny_folder  # noqa: E402 - a helper module beside the engine's tests

ATOL = 1e-4  # fp32 on both sides: only the order of the sums differs
TEXTS = ["The quick brown fox jumps over the lazy dog", "A", "Paris is the capital of France, and Berlin is"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_folder("llama", folder)


@pytest.fixture(scope="module")
def embed_server(tiny: tuple[Path, Any]) -> Iterator[ServerProcess]:
    folder, _ = tiny
    # a small step budget: the longer inputs are prefilled in chunks
    yield from running(
        "--model", str(folder), "--backend", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "16", "--served-model-name", "tiny",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(embed_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def hf_pooled(hf: Any, ids: list[int], pooling: str = "last") -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, hidden]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)


def _ids(tiny: tuple[Path, Any], text: str) -> list[int]:
    from plinth.model.loader import load_tokenizer, resolve_model

    return list(load_tokenizer(resolve_model(str(tiny[0]))).encode(text))


def test_openai_client_base64_and_float_equal_transformers(client: openai.OpenAI, tiny: tuple[Path, Any]) -> None:
    hf = tiny[1]
    ids = [_ids(tiny, t) for t in TEXTS]
    default = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    for resp in (default, floats):
        assert resp.model == "tiny" and resp.object == "list"
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, prompt in zip(resp.data, ids, strict=True):
            assert len(d.embedding) == 64
            torch.testing.assert_close(torch.tensor(d.embedding), hf_pooled(hf, prompt), atol=ATOL, rtol=0)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]  # float32 both ways


def test_token_ids_mean_pooling_and_raw_base64(
    client: openai.OpenAI, embed_server: ServerProcess, tiny: tuple[Path, Any]
) -> None:
    hf = tiny[1]
    ids = [_ids(tiny, t) for t in TEXTS]
    one = client.embeddings.create(model="tiny", input=ids[0], extra_body={"pooling": "mean"})
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), hf_pooled(hf, ids[0], "mean"), atol=ATOL, rtol=0)
    batch = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    with embed_server.client() as http:
        resp = http.post("/v1/embeddings", json={"input": ids[2], "encoding_format": "base64", "normalize": False})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    values = struct.unpack(f"<{len(raw) // 4}f", raw)  # little-endian float32
    assert len(values) == 64 and abs(sum(v * v for v in values) - 1.0) > 1e-3  # not normalised
    assert body["usage"] == {"prompt_tokens": len(ids[2]), "total_tokens": len(ids[2])}
    assert set(body) == {"object", "data", "model", "usage"} and body["data"][0]["object"] == "embedding"


BAD = [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input.1", "empty string"),
    ({"input": [[1, 2], []]}, "input.1", "empty"),
    ({"input": [1, 999999]}, "input", "outside the vocabulary"),
    ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, "input", f"context length is {MAX_MODEL_LEN}"),
    ({"input": "hi", "dimensions": 32}, "dimensions", "does not support truncation"),
    ({"input": "hi", "dimensions": 0}, "dimensions", ""),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "pooling": "cls"}, "pooling", ""),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ({"input": "hi", "bogus": 1}, "bogus", ""),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(
    embed_server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    with embed_server.client() as http:
        resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    err = resp.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_full_dimensions_and_openapi(client: openai.OpenAI, embed_server: ServerProcess) -> None:
    resp = client.embeddings.create(model="tiny", input="hi", dimensions=64, encoding_format="float")
    assert len(resp.data[0].embedding) == 64
    with embed_server.client() as http:
        spec = http.get("/openapi.json").json()
    op = spec["paths"]["/v1/embeddings"]["post"]
    assert "400" in op["responses"] and "422" not in op["responses"]
    assert "EmbeddingRequest" in spec["components"]["schemas"]


def test_generation_beside_embeddings_keeps_its_greedy_tokens(embed_server: ServerProcess) -> None:
    gen = {"prompt": TEXTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=embed_server.url, timeout=300) as http:
            alone = await http.post("/v1/completions", json=gen)
            together = await asyncio.gather(
                http.post("/v1/completions", json=gen),
                *(http.post("/v1/embeddings", json={"input": TEXTS * 4, "pooling": p}) for p in ("last", "mean")),
            )
            return alone, list(together)

    alone, (beside, *embedded) = asyncio.run(main())
    assert alone.status_code == beside.status_code == 200
    assert beside.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert all(r.status_code == 200 and len(r.json()["data"]) == 12 for r in embedded)
