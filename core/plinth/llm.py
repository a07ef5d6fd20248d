"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, ``.chat(messages)`` and
``.embed(inputs)``.

The prompt forms are vLLM's, since users port code from it: a string, a list of token ids, a
``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}`` dict, or a list of any of these. Anything
else is refused before a request is queued, with an error naming the argument (``prompts[2]``,
``messages[0]["content"]``) and what was expected there.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from plinth.config import EngineConfig
from plinth.platform.host import PluginHost
from plinth.pooling_params import PoolingParams
from plinth.runtime.engine import InvalidRequest, LLMEngine
from plinth.runtime.outputs import EmbeddingOutput, RequestOutput
from plinth.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's text prompt: ``{"prompt": "..."}`` (encoded with the model's tokenizer)."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's pre-tokenized prompt: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt
Message = dict[str, Any]

_PROMPT_FORMS = 'a str, a list of token ids (ints), {"prompt": str} or {"prompt_token_ids": [int, ...]}'
_MESSAGE_FORM = '{"role": str, "content": str or [{"type": "text", "text": str}, ...]}'


class LLM:
    """An engine for offline batch generation.

    :param model: a Hugging Face folder or a GGUF file; None for the default SmolLM2 model.
    :param backend: a backend name; None to pick the best one installed.
    :param lora: LoRA adapters to load at start-up, ``{name: PEFT folder}`` (turns ``enable_lora``
        on); a request selects one with ``generate(..., lora=name)``.
    :param kwargs: any other :class:`plinth.config.EngineConfig` field (validated: an ill-typed or
        out-of-range value raises :class:`~plinth.validation.InvalidParameter` naming the field, a
        misspelled option ``TypeError``).
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str | None = None,
        host: PluginHost | None = None,
        lora: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        if lora:
            kwargs.setdefault("enable_lora", True)
        self.engine = LLMEngine(EngineConfig(model=model, backend=backend, **kwargs), host=host)
        self._ids = itertools.count()
        try:
            for name, path in (lora or {}).items():
                self.add_lora(name, path)
        except BaseException:
            self.engine.close()
            raise

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter in folder ``path`` as ``name`` (needs ``enable_lora=True``).

        :raises plinth.runtime.engine.InvalidRequest: the adapter is refused (the message names the
            field at fault), the name is taken, or every slot (``max_loras``) is in use.
        """
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``, freeing its slot."""
        self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return self.engine.list_loras()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; outputs in prompt order.

        :param prompts: one prompt or a list of them; a prompt is a str, a list of token ids, or vLLM's
            ``{"prompt": str}`` / ``{"prompt_token_ids": [int, ...]}``.
        :param params: one SamplingParams for all prompts, or a list of them, one per prompt.
        :param on_output: called with every intermediate output (for streaming or progress); what it
            raises stops the call and aborts its unfinished requests.
        :param lora: the name of a loaded LoRA adapter for every prompt, or a list with one name (or
            None: the base model) per prompt; None: the base model.
        :raises TypeError: a prompt or ``params`` of the wrong type (the message names which one).
        :raises plinth.runtime.engine.InvalidRequest: a prompt is refused (not valid text, empty, too
            long, ...); none of this call's requests run.
        """
        prompt_list = _prompt_list(prompts)
        loras = _lora_list(lora, len(prompt_list))
        return self._generate(prompt_list, _param_list(params, len(prompt_list)), on_output, "prompts", loras)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate its reply.

        :param messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list
            of conversations. ``content`` is a str or a list of text parts
            (``{"type": "text", "text": ...}``, joined), as in the OpenAI API.
        :param params: as for :meth:`generate`, one per conversation.
        :param on_output: as for :meth:`generate`.
        :raises TypeError: a message of the wrong shape (the message names which one).
        :raises plinth.runtime.engine.InvalidRequest: a conversation is refused (not valid text, too long).
        :raises plinth.model.tokenizer.ChatTemplateError: the model has no template, or it rejected the input.
        """
        conversations = _conversations(messages)
        prompt_list: list[str | list[int]] = [self._encode_chat(conv, add_generation_prompt) for conv in conversations]
        return self._generate(prompt_list, _param_list(params, len(prompt_list)), on_output, "messages")

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[EmbeddingOutput]:
        """Embed every input, batched continuously (with any generation in the engine); outputs in
        input order.

        The vector pools the final hidden states (after the model's final norm, before the LM
        head) in float32; see :class:`~plinth.pooling_params.PoolingParams`.

        :param prompts: one input or a list of them, in the forms :meth:`generate` takes (a str, a
            list of token ids, a list of either).
        :param pooling: ``"last"`` (the final token's hidden state) or ``"mean"`` (the average over
            every token).
        :param normalize: scale each vector to unit L2 norm.
        :param dimensions: keep the first ``dimensions`` values; only for a model whose config
            declares Matryoshka dimensions (else anything but the full hidden size is refused).
        :raises TypeError: an input of the wrong type (the message names which one).
        :raises plinth.validation.InvalidParameter: a bad ``pooling``, ``normalize`` or ``dimensions``.
        :raises plinth.runtime.engine.InvalidRequest: an input is refused (empty, too long, ids outside
            the vocabulary, a truncation the model does not allow); none of this call's inputs run.
        """
        prompt_list = _prompt_list(prompts)
        params = PoolingParams(pooling=pooling, normalize=normalize, dimensions=dimensions)
        ids = [f"embd-{next(self._ids)}" for _ in prompt_list]
        try:
            for i, (rid, prompt) in enumerate(zip(ids, prompt_list, strict=True)):
                try:
                    self.engine.add_embedding_request(rid, prompt, params)
                except InvalidRequest as exc:
                    if len(prompt_list) == 1:
                        raise
                    raise InvalidRequest(f"prompts[{i}]: {exc}") from exc
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        outs = self._run(ids, None)
        return [EmbeddingOutput(list(o.embedding or ()), len(o.prompt_token_ids)) for o in outs]

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The prompt token ids :meth:`chat` sends for one conversation (to count or trim it first).

        :raises TypeError, InvalidRequest: as for :meth:`chat`.
        """
        if not isinstance(messages, list | tuple):
            raise TypeError(f"messages must be a list of messages {_MESSAGE_FORM}; got {_describe(messages)}")
        return self._encode_chat(_conversation(messages, "messages"), add_generation_prompt)

    def _encode_chat(self, conversation: list[Message], add_generation_prompt: bool) -> list[int]:
        text = self.engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _generate(
        self,
        prompt_list: list[str | list[int]],
        param_list: list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None,
        name: str,
        loras: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        lora_list = loras if loras is not None else [None] * len(prompt_list)
        try:
            for i, (rid, prompt, p, lora) in enumerate(zip(ids, prompt_list, param_list, lora_list, strict=True)):
                try:
                    self.engine.add_request(rid, prompt, p, lora=lora)
                except InvalidRequest as exc:
                    if len(prompt_list) == 1:
                        raise
                    raise InvalidRequest(f"{name}[{i}]: {exc}") from exc  # which of the batch
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, on_output)

    def _run(self, ids: list[str], on_output: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        stepping = False
        try:
            while pending:
                stepping = True
                outputs = self.engine.step()
                stepping = False
                for out in outputs:
                    if on_output is not None:
                        on_output(out)
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            if stepping:  # step() raised midway (Ctrl-C, a kernel error): only abort_all forgets that step
                self.engine.abort_all()
            for rid in pending:  # interrupted: leave the engine clean for the next call
                self.engine.abort_request(rid)
        return [final[rid] for rid in ids]


# -- argument checks -----------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    """``value`` for an error message: its repr (shortened) and, unless obvious, its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if value is None or isinstance(value, bool | str):
        return text
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    hint = ""
    if isinstance(value, bytes | bytearray):
        hint = "; decode it to a str first"
    elif hasattr(value, "tolist") and not isinstance(value, list | tuple):
        hint = "; convert an array of token ids with .tolist()"  # numpy arrays, torch tensors
    return f"{text} ({name}{hint})"


def check_text(value: str, where: str) -> str:
    """``value`` if it can be encoded as UTF-8; a lone surrogate (``"\\ud800"``) cannot, and is refused.

    :raises InvalidRequest: naming ``where`` and the offending character's position.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # only surrogates fail to encode as UTF-8
        raise InvalidRequest(
            f"{where} is not valid text: {value[exc.start]!r} at character {exc.start} is a lone surrogate "
            "(half of a UTF-16 pair), which UTF-8 cannot encode"
        ) from None
    return value


def _is_token_id(value: Any) -> bool:
    # numbers.Integral takes numpy's integers too; a bool is an int but never a token id
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(value: Sequence[Any], where: str) -> list[int]:
    for i, t in enumerate(value):
        if not _is_token_id(t):
            raise TypeError(f"{where}[{i}] must be a token id (int), got {_describe(t)}")
    return [int(t) for t in value]


def _one_prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, list | tuple):
        return _token_ids(value, where)
    if isinstance(value, Mapping):
        keys = set(value)
        if keys == {"prompt"}:
            text = value["prompt"]
            if not isinstance(text, str):
                raise TypeError(f'{where}["prompt"] must be a str, got {_describe(text)}')
            return check_text(text, f'{where}["prompt"]')
        if keys == {"prompt_token_ids"}:
            ids = value["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise TypeError(f'{where}["prompt_token_ids"] must be a list of ints, got {_describe(ids)}')
            return _token_ids(ids, f'{where}["prompt_token_ids"]')
        raise InvalidRequest(
            f'{where} must have exactly one key, "prompt" or "prompt_token_ids"; got keys {sorted(map(str, keys))}'
            + (" (plinth's models take text only)" if "multi_modal_data" in keys else "")
        )
    raise TypeError(f"{where} must be {_PROMPT_FORMS}; got {_describe(value)}")


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    """Every prompt of ``generate``'s first argument, checked; a lone prompt becomes a list of one."""
    if isinstance(prompts, str | Mapping):
        return [_one_prompt(prompts, "prompts")]
    if isinstance(prompts, list | tuple):
        if prompts and _is_token_id(prompts[0]):  # one prompt of token ids
            return [_one_prompt(prompts, "prompts")]
        return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    raise TypeError(f"prompts must be {_PROMPT_FORMS}, or a list of these; got {_describe(prompts)}")


def _param_list(params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from ``params`` (None, one for all, or one per prompt)."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, list | tuple):
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be a SamplingParams, got {_describe(p)}")
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts: give one for all, or one per prompt")
        return list(params)
    hint = " (build one with SamplingParams(**params))" if isinstance(params, Mapping) else ""
    raise TypeError(
        f"params must be a SamplingParams, a list of them (one per prompt) or None; got {_describe(params)}{hint}"
    )


def _lora_list(lora: Any, n: int) -> list[str | None]:
    """One adapter name (or None) per prompt from ``generate``'s ``lora`` argument."""
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if not isinstance(lora, Sequence) or not all(x is None or isinstance(x, str) for x in lora):
        raise TypeError(f"lora must be an adapter name, None, or a list of those; got {_describe(lora)}")
    if len(lora) != n:
        raise TypeError(f"lora has {len(lora)} entries for {n} prompts")
    return list(lora)


def _conversations(messages: Any) -> list[list[Message]]:
    """``chat``'s conversations, each checked (one conversation becomes a list of one)."""
    expected = f"a list of messages {_MESSAGE_FORM}, or a list of such conversations"
    if not isinstance(messages, list | tuple):
        raise TypeError(f"messages must be {expected}; got {_describe(messages)}")
    if not messages:
        return []
    if isinstance(messages[0], Mapping):  # one conversation
        return [_conversation(messages, "messages")]
    out = []
    for c, conv in enumerate(messages):
        if not isinstance(conv, list | tuple):
            raise TypeError(f"messages[{c}] must be a list of messages {_MESSAGE_FORM}; got {_describe(conv)}")
        out.append(_conversation(conv, f"messages[{c}]"))
    return out


def _conversation(conv: Sequence[Any], where: str) -> list[Message]:
    return [_message(m, f"{where}[{i}]") for i, m in enumerate(conv)]


def _message(msg: Any, where: str) -> Message:
    """A checked copy of one message, its content as one string (text parts joined)."""
    if not isinstance(msg, Mapping):
        raise TypeError(f"{where} must be a message {_MESSAGE_FORM}; got {_describe(msg)}")
    role = msg.get("role")
    if not isinstance(role, str):
        raise TypeError(f'{where}["role"] must be a str such as "user" or "assistant", got {_describe(role)}')
    content = msg.get("content")
    if content is None:
        content = ""  # an assistant turn that only called tools, as in the OpenAI API
    elif isinstance(content, list | tuple):
        texts = []
        for i, part in enumerate(content):
            at = f'{where}["content"][{i}]'
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else None
                raise TypeError(
                    f'{at} must be a text part {{"type": "text", "text": str}}; got '
                    + (f"a part of type {kind!r} (plinth's models take text only)" if kind else _describe(part))
                )
            if not isinstance(part.get("text"), str):
                raise TypeError(f'{at}["text"] must be a str, got {_describe(part.get("text"))}')
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise TypeError(f'{where}["content"] must be a str or a list of text parts, got {_describe(content)}')
    checked = {**msg, "role": role, "content": content}
    _check_strings(checked, where)
    return checked


def _check_strings(value: Any, where: str) -> None:
    """Refuse a lone surrogate in any string of a message (the template would pass it to the tokenizer)."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_strings(item, f'{where}["{key}"]')
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")
