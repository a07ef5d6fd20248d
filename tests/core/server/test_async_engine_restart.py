"""``AsyncEngine`` with a restart allowed (``plinth serve --restart-workers``), in process: a worker
failure fails the requests the engine held, a rebuilt engine serves the next ones, requests during the
rebuild are refused with 503's exception, and a failed rebuild or one failure too many is fatal."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from plinth import LLM, SamplingParams
from plinth.parallel.executor import WorkerFailure
from plinth.runtime.engine import LLMEngine
from plinth.server.async_engine import AsyncEngine, EngineError, EngineRestarting
from plinth_conformance.tiny_models import save_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("restart") / "llama")


def _engine(folder: Path) -> LLMEngine:
    return LLM(model=str(folder), backend="cpu", num_kv_blocks=32, max_model_len=128).engine


def _dying(engine: LLMEngine) -> LLMEngine:
    """``engine`` whose next step fails as a dead rank's does (the engine then stays failed)."""

    def execute(*args: Any, **kwargs: Any) -> Any:
        raise WorkerFailure("rank 1 is gone (injected)")

    engine.runner.execute = execute  # type: ignore[method-assign]
    return engine


async def _tokens(aengine: AsyncEngine, rid: str) -> list[int]:
    last = None
    async for out in aengine.generate(rid, [5, 6, 7, 8], PARAMS):
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def test_a_worker_failure_fails_the_request_then_a_rebuilt_engine_serves(tiny: Path) -> None:
    want = asyncio.run(_run_plain(tiny))
    built: list[LLMEngine] = []
    gate = threading.Event()

    def rebuild() -> LLMEngine:
        gate.wait(30)  # hold the rebuild until the test has seen a request refused meanwhile
        built.append(_engine(tiny))
        return built[-1]

    async def main() -> tuple[BaseException, BaseException, list[int]]:
        aengine = AsyncEngine(_dying(_engine(tiny)), rebuild=rebuild, max_restarts=1)
        fatal: list[BaseException] = []
        aengine.on_fatal = fatal.append
        await aengine.start()
        try:
            failed = await asyncio.gather(_tokens(aengine, "a"), return_exceptions=True)
            while not aengine.restarting:
                await asyncio.sleep(0.01)
            assert not aengine.is_running  # /health answers 503 meanwhile
            refused = await asyncio.gather(_tokens(aengine, "b"), return_exceptions=True)
            gate.set()
            while aengine.restarting:
                await asyncio.sleep(0.01)
            ok = await _tokens(aengine, "c")
            assert aengine.is_running and not fatal and aengine.stats.num_restarts_total == 1
            return failed[0], refused[0], ok
        finally:
            await aengine.shutdown()

    failed, refused, ok = asyncio.run(main())
    assert isinstance(failed, EngineError) and "rank 1 is gone" in str(failed)
    assert isinstance(refused, EngineRestarting)
    assert ok == want and len(built) == 1


async def _run_plain(tiny: Path) -> list[int]:
    aengine = AsyncEngine(_engine(tiny))
    await aengine.start()
    try:
        return await _tokens(aengine, "plain")
    finally:
        await aengine.shutdown()


@pytest.mark.parametrize("how", ["rebuild-raises", "no-restart-left"])
def test_a_failed_rebuild_or_one_failure_too_many_is_fatal(tiny: Path, how: str) -> None:
    def rebuild() -> LLMEngine:
        if how == "rebuild-raises":
            raise RuntimeError("the workers could not start (injected)")
        return _dying(_engine(tiny))  # the rebuilt engine fails too: no restart is left for it

    async def main() -> tuple[list[BaseException], BaseException, BaseException]:
        aengine = AsyncEngine(_dying(_engine(tiny)), rebuild=rebuild, max_restarts=1)
        fatal: list[BaseException] = []
        aengine.on_fatal = fatal.append
        await aengine.start()
        try:
            first = (await asyncio.gather(_tokens(aengine, "a"), return_exceptions=True))[0]
            if how == "no-restart-left":
                while aengine.restarting or aengine.num_restarts == 0:
                    await asyncio.sleep(0.01)
                await asyncio.gather(_tokens(aengine, "b"), return_exceptions=True)
            while not fatal:
                await asyncio.sleep(0.01)
            after = (await asyncio.gather(_tokens(aengine, "c"), return_exceptions=True))[0]
            return fatal, first, after
        finally:
            await aengine.shutdown()

    fatal, first, after = asyncio.run(main())
    assert isinstance(first, EngineError)
    assert len(fatal) == 1 and isinstance(fatal[0], WorkerFailure)  # the worker's failure, named, stays the cause
    assert isinstance(after, EngineError) and "the engine stopped" in str(after)


def test_restarts_need_a_rebuild() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        AsyncEngine(None, max_restarts=1)  # type: ignore[arg-type]


def test_a_rebuilt_engine_loads_again_the_adapters_loaded_at_run_time(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The rebuild loads the command line's adapters; those loaded after the start come back too (in
    load order), and one whose folder is gone is logged and left out while the rest serve."""
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "engine"))
    from engine_helpers import save_tiny_folder
    from lora_helpers import save_peft_adapter

    root = tmp_path_factory.mktemp("restart-lora")
    hf = save_tiny_folder("llama", root / "base")
    for name, seed in (("early", 1), ("late", 2), ("gone", 3)):
        save_peft_adapter(hf, root / name, r=4, seed=seed)

    def build() -> LLMEngine:
        llm = LLM(model=str(root / "base"), backend="cpu", num_kv_blocks=32, max_model_len=128, max_loras=3,
                  lora={"early": str(root / "early")})  # fmt: skip
        return llm.engine

    async def main() -> list[str]:
        engine = build()
        engine.add_lora("late", str(root / "late"))
        engine.add_lora("gone", str(root / "gone"))
        shutil.rmtree(root / "gone")
        aengine = AsyncEngine(_dying(engine), rebuild=build, max_restarts=1)
        await aengine.start()
        try:
            await asyncio.gather(_tokens(aengine, "a"), return_exceptions=True)
            while aengine.stats.num_restarts_total == 0 or aengine.restarting:
                await asyncio.sleep(0.01)
            return aengine.engine.list_loras()
        finally:
            await aengine.shutdown()

    with caplog.at_level("ERROR"):
        assert asyncio.run(main()) == ["early", "late"]
    assert "LoRA adapter 'gone'" in caplog.text and "did not load again" in caplog.text
