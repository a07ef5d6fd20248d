"""Multi-LoRA over HTTP with the official ``openai`` client against a real ``plinth serve --lora``:
``/v1/models`` lists the adapters, ``model`` selects one (outputs equal the offline API's), and the
admin routes load and unload adapters behind the API key with clear refusals."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import ServerProcess, running

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "engine"))  # engine_helpers
from engine_helpers import save_tiny_folder  # noqa: E402
from lora_helpers import save_peft_adapter  # noqa: E402

KEY = "lora-test-key"
PROMPT = "The quick brown fox"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serve")
    hf = save_tiny_folder("llama", root / "base")
    save_peft_adapter(hf, root / "a1", r=8, seed=1)
    save_peft_adapter(hf, root / "a2", r=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))
    return {"base": root / "base", "a1": root / "a1", "a2": root / "a2", "missing": root / "missing"}


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[ServerProcess]:
    yield from running(
        "--model",
        str(folders["base"]),
        "--served-model-name",
        "tiny",
        "--lora",
        f"a1={folders['a1']}",
        "--max-loras",
        "2",
        "--num-kv-blocks",
        "256",
        "--backend",
        "cpu",
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def offline(folders: dict[str, Path]) -> dict[str | None, str]:
    """The offline API's greedy text of PROMPT with no adapter, a1 and a2."""
    from plinth import LLM, SamplingParams

    llm = LLM(
        model=str(folders["base"]),
        backend="cpu",
        num_kv_blocks=256,
        lora={"a1": str(folders["a1"]), "a2": str(folders["a2"])},
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {name: llm.generate(PROMPT, greedy, lora=name)[0].outputs[0].text for name in (None, "a1", "a2")}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _admin(server: ServerProcess, route: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=120)


def test_models_lists_the_adapters_and_model_selects_one(client: openai.OpenAI, offline: dict[str | None, str]) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "a1"]
    assert models["a1"].model_extra is not None and models["a1"].model_extra["parent"] == "tiny"
    assert _complete(client, "a1") == offline["a1"]
    assert _complete(client, "tiny") == offline[None]
    assert offline["a1"] != offline[None]
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "a1"
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist") as err:
        _complete(client, "nope")
    assert err.value.body is not None and err.value.body.get("param") == "model"  # type: ignore[union-attr]


def test_admin_routes_load_and_unload(
    server: ServerProcess, client: openai.OpenAI, folders: dict[str, Path], offline: dict[str | None, str]
) -> None:
    load = {"lora_name": "a2", "lora_path": str(folders["a2"])}
    assert _admin(server, "load_lora_adapter", load, key=None).status_code == 401
    assert _admin(server, "load_lora_adapter", load, key="wrong").status_code == 401
    ok = _admin(server, "load_lora_adapter", load)
    assert ok.status_code == 200, ok.text
    assert _complete(client, "a2") == offline["a2"]
    assert [m.id for m in client.models.list().data] == ["tiny", "a1", "a2"]

    refusals = [
        (load, "already loaded", "lora_name"),  # duplicate
        ({"lora_name": "a3", "lora_path": str(folders["a1"])}, "no free LoRA slot", "lora_name"),  # max_loras 2
        ({"lora_name": "tiny", "lora_path": str(folders["a1"])}, "the base model's served name", "lora_name"),
    ]
    for body, message, param in refusals:
        r = _admin(server, "load_lora_adapter", body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == param
    bad_field = _admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": "rel"})
    assert bad_field.status_code == 400  # still no free slot: the slot check comes first

    unload = _admin(server, "unload_lora_adapter", {"lora_name": "a2"})
    assert unload.status_code == 200, unload.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2")
    missing = _admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(folders["missing"])})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert "is not a folder" in missing.json()["error"]["message"]
    again = _admin(server, "unload_lora_adapter", {"lora_name": "a2"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"
    assert _complete(client, "a1") == offline["a1"]  # the other adapter kept serving


def test_unloading_an_adapter_a_stream_uses_lets_it_finish(
    server: ServerProcess, client: openai.OpenAI, folders: dict[str, Path], offline: dict[str | None, str]
) -> None:
    assert _admin(server, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(folders["a2"])}).is_success
    stream = client.completions.create(
        model="a2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert _admin(server, "unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):  # new requests: refused at once
        _complete(client, "a2")
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline["a2"]  # the running one finished with its adapter
    # its slot is free again once it ended
    assert _admin(server, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(folders["a2"])}).is_success
    assert _complete(client, "a2") == offline["a2"]
