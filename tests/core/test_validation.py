"""The field checks of plinth's parameter records (EngineConfig, SamplingParams)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from plinth.config import EngineConfig
from plinth.sampling_params import SamplingParams
from plinth.validation import InvalidParameter, check_float, check_int, check_list, check_str


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"n": True}, "n", "integer"),
        ({"max_tokens": 2.5}, "max_tokens", "integer"),
        ({"temperature": math.nan}, "temperature", "number"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"top_k": -2}, "top_k", "at least -1"),
        ({"seed": 2**64}, "seed", "less than"),
        ({"stop": 5}, "stop", "list of str"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "item 1"),
        ({"ignore_eos": 1}, "ignore_eos", "true or false"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "must not exceed"),
    ],
)
def test_sampling_params_reject_with_the_field(kwargs: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidParameter, match=words) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and str(err.value).startswith(f"SamplingParams.{field}: ")


def test_sampling_params_normalise_what_they_accept() -> None:
    p = SamplingParams(max_tokens=8.0, top_k=-1, stop="END", stop_token_ids=(3, 4), temperature=0)
    assert p.max_tokens == 8 and isinstance(p.max_tokens, int)
    assert p.top_k == 0 and p.stop == ["END"] and p.stop_token_ids == [3, 4]
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.greedy
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams() == SamplingParams() and SamplingParams(n=2) != SamplingParams()
    with pytest.raises(AttributeError):
        p.n = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_engine_config_checks_its_fields() -> None:
    assert EngineConfig().quantization == "auto" and EngineConfig().max_num_seqs == 64
    with pytest.raises(InvalidParameter, match="quantization: must be one of 'auto', 'none', 'int8', got 'fp4'"):
        EngineConfig(quantization="fp4")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="block_size: must be at most 1024"):
        EngineConfig(block_size=4096)
    with pytest.raises(InvalidParameter, match="kv_cache_memory_gb: must be greater than 0"):
        EngineConfig(kv_cache_memory_gb=0)
    with pytest.raises(InvalidParameter, match="model: must be a string or None"):
        EngineConfig(model=5)  # type: ignore[arg-type]
    assert EngineConfig(kv_cache_memory_gb=2).kv_cache_memory_gb == 2.0


def test_checks_return_the_value_in_its_type() -> None:
    assert check_int("R", "f", 3.0) == 3 and check_int("R", "f", None, optional=True) is None
    assert check_float("R", "f", 2, ge=2) == 2.0
    assert check_str("R", "f", "a", choices=("a", "b")) == "a"
    assert check_list("R", "f", ("x",), str) == ["x"]
    with pytest.raises(InvalidParameter, match="R.f: must be an integer, got None"):
        check_int("R", "f", None)
    with pytest.raises(InvalidParameter, match="must be a number, got inf|at most"):
        check_float("R", "f", math.inf, le=1.0)


def test_generate_imports_no_pydantic() -> None:
    """The CLI's generation path stays off pydantic (about 0.3 s of the cold start)."""
    code = "import sys, plinth.cli, plinth.llm, plinth.runtime.engine; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
