"""The engine's side of embedding requests: their checks, their table, and their finished outputs.

An embedding request runs through the same scheduler and runner as generation: its prompt is
scheduled (chunked like any prompt, batched with decodes), the runner pools the final hidden states
(:mod:`plinth.runtime.pooler`), and the scheduler finishes it once the prompt is computed. Here the
vector is truncated (``dimensions``) and normalised, and handed back as a finished
:class:`~plinth.runtime.outputs.RequestOutput` with ``embedding`` set.

``dimensions`` other than the hidden size is allowed only for a model whose ``config.json`` declares
Matryoshka dimensions (``matryoshka_dimensions``, as sentence-transformers writes it): a decoder LM
not trained that way gives a meaningless prefix of its hidden state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plinth.model.config import ModelConfig
from plinth.pooling_params import PoolingParams
from plinth.runtime.outputs import RequestMetrics, RequestOutput
from plinth.runtime.parts import InvalidRequest
from plinth.sampling_params import SamplingParams
from plinth.sched.request import Request, SequenceId, StopCriteria

#: what an embedding ``Request`` carries as its sampling parameters: never read, since its chunks
#: carry a Pool and no samples (the scheduler's ``P`` is the engine's SamplingParams)
SAMPLES_NOTHING = SamplingParams(max_tokens=1)


def check_dimensions(config: ModelConfig, dimensions: int | None) -> None:
    """Refuse a ``dimensions`` the model does not allow (see the module docstring).

    :raises InvalidRequest: naming ``dimensions`` and what the model allows.
    """
    hidden = config.hidden_size
    if dimensions is None or dimensions == hidden:
        return
    allowed = config.matryoshka_dimensions
    if not allowed:
        raise InvalidRequest(
            f"dimensions={dimensions}: this model does not support truncation (its config declares no "
            f"Matryoshka dimensions); omit dimensions or pass its full size {hidden}"
        )
    if dimensions not in allowed:
        raise InvalidRequest(
            f"dimensions={dimensions}: this model allows {sorted(allowed)} (or its full size {hidden})"
        )


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """The pooled float32 ``vector`` [hidden] truncated to ``params.dimensions`` and normalised."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    values: list[float] = vector.tolist()  # to host memory, whatever the device
    return values


@dataclass(slots=True)
class _Embedding:
    """Engine-side state of one embedding request."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    metrics: RequestMetrics


class EmbeddingRequests:
    """The embedding requests in the engine, by request id (the engine keeps generation's apart)."""

    def __init__(self) -> None:
        self._table: dict[str, _Embedding] = {}

    def __bool__(self) -> bool:
        """True while any embedding request is unfinished."""
        return bool(self._table)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._table

    def ids(self) -> list[str]:
        """The unfinished requests' ids."""
        return list(self._table)

    def metrics(self, request_id: str) -> RequestMetrics | None:
        """The metrics of an unfinished request, or None."""
        entry = self._table.get(request_id)
        return None if entry is None else entry.metrics

    def make(
        self, request_id: str, prompt_ids: list[int], params: PoolingParams, config: ModelConfig, max_model_len: int
    ) -> Request:
        """The scheduler's ``Request`` for an input's token ids, checked; :meth:`add` it once the
        scheduler took it.

        :raises InvalidRequest: an empty input, token ids outside the vocabulary, more tokens than
            the context length, a ``dimensions`` the model does not allow.
        """
        check_dimensions(config, params.dimensions)
        if not prompt_ids:
            raise InvalidRequest("the input is empty")
        vocab = config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"input token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_ids) > max_model_len:
            raise InvalidRequest(f"the input has {len(prompt_ids)} tokens; the context length is {max_model_len}")
        return Request(request_id, prompt_ids, StopCriteria(max_tokens=0), params=SAMPLES_NOTHING, pooling=params.kind)

    def add(self, request: Request, text: str | None, params: PoolingParams) -> None:
        """Track ``request`` (queued in the scheduler) until its vector arrives."""
        ids = request.prompt_token_ids
        metrics = RequestMetrics(request.arrival_time, num_prompt_tokens=len(ids))
        self._table[request.request_id] = _Embedding(text, ids, params, metrics)

    def discard(self, request_id: str) -> bool:
        """Forget an aborted request; True when it was one of these."""
        return self._table.pop(request_id, None) is not None

    def outputs(self, pooled: dict[SequenceId, torch.Tensor]) -> list[RequestOutput]:
        """The finished outputs of the requests whose vectors the runner pooled this step (ids no
        longer tracked, aborted meanwhile, are dropped)."""
        out = []
        now = time.monotonic()
        for seq_id, vector in pooled.items():
            entry = self._table.pop(seq_id.request_id, None)
            if entry is None:
                continue
            m = entry.metrics
            m.finished_time = now
            out.append(
                RequestOutput(
                    request_id=seq_id.request_id,
                    prompt=entry.prompt,
                    prompt_token_ids=entry.prompt_token_ids,
                    outputs=[],
                    metrics=m,
                    finished=True,
                    embedding=finish_vector(vector, entry.params),
                )
            )
        return out
