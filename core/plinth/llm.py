"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from plinth.config import EngineConfig
from plinth.platform.host import PluginHost
from plinth.runtime.engine import LLMEngine
from plinth.runtime.outputs import RequestOutput
from plinth.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """An engine for offline batch generation.

    :param model: a Hugging Face folder or a GGUF file; None for the default SmolLM2 model.
    :param backend: a backend name; None to pick the best one installed.
    :param kwargs: any other :class:`plinth.config.EngineConfig` field (validated: an ill-typed or
        out-of-range value raises :class:`~plinth.validation.InvalidParameter` naming the field, a
        misspelled option ``TypeError``).
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str | None = None,
        host: PluginHost | None = None,
        **kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, backend=backend, **kwargs), host=host)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), batched continuously; outputs in prompt order.

        :param params: one SamplingParams for all prompts, or one per prompt.
        :param on_output: called with every intermediate output (for streaming or progress).
        :raises plinth.runtime.engine.InvalidRequest: a prompt is refused; none of this call's requests run.
        """
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, p in zip(ids, prompt_list, param_list, strict=True):
                self.engine.add_request(rid, prompt, p)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, on_output)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate its reply."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[Message]] = [messages] if single else messages  # type: ignore[list-item,assignment]
        prompts = [
            self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        token_prompts = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, params)

    def _run(self, ids: list[str], on_output: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        try:
            while pending:
                for out in self.engine.step():
                    if on_output is not None:
                        on_output(out)
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for rid in pending:  # interrupted: leave the engine clean for the next call
                self.engine.abort_request(rid)
        return [final[rid] for rid in ids]
