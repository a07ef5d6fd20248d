"""``plinth bench``: a user's mistake (a bad option, an unreachable server, an unusable dataset, a failed
cold-start run) is a message and status 2, never a traceback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from plinth.bench import BenchError
from plinth.bench.datasets import sharegpt
from plinth.bench.latency import measure_cold_start
from plinth.cli import main


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "serve", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, got '0'"),
        (["bench", "serve", "--concurrency", "many"], "argument --concurrency: must be an integer, got 'many'"),
        (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be greater than 0"),
        (["bench", "serve", "--json", "/no/such/dir/out.json"], "no such directory '/no/such/dir'"),
        (["bench", "throughput", "--json", "."], "'.' is a directory; name a file"),
        (["bench", "latency", "--output-len", "1"], "argument --output-len: must be at least 2"),
        (["bench", "latency", "--iters", "0"], "argument --iters: must be at least 1"),
        (["bench", "throughput", "--passes", "0"], "argument --passes: must be at least 1"),
        (["bench", "prefill", "--input-len", "0"], "argument --input-len: must be at least 1"),
        (["bench", "prefill", "--json", "."], "'.' is a directory; name a file"),
        (["bench", "speculative", "--max-tokens", "0"], "argument --max-tokens: must be at least 1"),
        (
            ["bench", "latency", "--num-speculative-tokens", "-1"],
            "argument --num-speculative-tokens: must be at least 0",
        ),
        (["bench", "speculative", "--ngram-prompt-lookup-min", "0"], "argument --ngram-prompt-lookup-min: must be at"),
    ],
)
def test_bad_bench_options_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_serve_user_errors_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["bench", "serve", "--url", url, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"plinth: error: cannot reach the server at {url}: ConnectError" in err and "Traceback" not in err

    assert main(["bench", "serve", "--url", "localhost:8000", "--no-progress"]) == 2
    assert "--url 'localhost:8000' must start with http:// or https://" in capsys.readouterr().err

    dataset = tmp_path / "chats.json"
    for content in ('["a", 1, {"conversations": "nope"}]', '{"conversations": []}'):
        dataset.write_text(content)
        argv = ["bench", "serve", "--url", url, "--model", "m", "--dataset", str(dataset), "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{dataset}: no usable ShareGPT conversations" in err and "Traceback" not in err

    assert main(["bench", "serve", "--dataset", str(tmp_path / "missing.json"), "--model", "m"]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_sharegpt_skips_items_of_the_wrong_shape(tmp_path: Path) -> None:
    from plinth.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    good = {"conversations": [{"value": "Tell me a story about a cat."}, {"value": "Once " * 20}]}
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(["text", 3, {"conversations": "nope"}, {"conversations": ["a", "b"]}, good]))
    assert len(sharegpt(path, tok, 10)) == 1
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="no usable ShareGPT conversations"):
        sharegpt(path, tok, 10)


def test_a_failed_cold_start_run_is_reported_with_its_error() -> None:
    with pytest.raises(BenchError, match=r"the cold-start run .* failed \(status 2\): .*/no/such/model"):
        measure_cold_start("/no/such/model", None)
