"""Pooling parameters: how an embedding request's prompt becomes one vector, checked field by field."""

from __future__ import annotations

from dataclasses import dataclass

from plinth.sched.request import Pooling
from plinth.validation import check_bool, check_int, check_str

#: the ``pooling`` names users write, and what they mean
POOLINGS = {"last": Pooling.LAST, "mean": Pooling.MEAN}


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """How to turn a prompt's final hidden states (after the model's final norm, before the LM head)
    into an embedding.

    - ``pooling``: ``"last"`` (the final prompt token's hidden state; the usual choice for decoder
      models, whose last token has seen the whole text) or ``"mean"`` (the average over every
      prompt token; such a request computes its whole prompt, never taking prefix-cache hits).
    - ``normalize``: scale the vector to unit L2 norm (after any truncation).
    - ``dimensions`` (>= 1): keep the first ``dimensions`` values; None: all of them. The engine
      allows a truncation only for a model whose config declares Matryoshka dimensions.

    The vector is computed in float32. A value of the wrong type or out of range raises
    :class:`~plinth.validation.InvalidParameter` naming the field.
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_str(owner, "pooling", self.pooling, choices=POOLINGS)
        check_bool(owner, "normalize", self.normalize)
        check_int(owner, "dimensions", self.dimensions, optional=True, ge=1)

    @property
    def kind(self) -> Pooling:
        """The scheduler's :class:`~plinth.sched.request.Pooling` for ``pooling``."""
        return POOLINGS[self.pooling]
