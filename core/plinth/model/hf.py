"""Hugging Face checkpoint folders: config.json and safetensors (single file or sharded).

Pickle checkpoints (``*.bin``, ``*.pt``) can run arbitrary code when unpickled, so they are refused
unless the caller opts in; even then they are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plinth.model.config import ModelConfig
from plinth.platform.devices import HOST

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


class PickleCheckpointRefused(ValueError):
    """A folder holds only pickle weights and the caller did not opt in to reading them."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, with the path in the error when it is malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def hf_config(folder: Path) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face folder's ``config.json``."""
    path = folder / "config.json"
    return ModelConfig.from_hf_config(read_json(path), source=str(path))


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors shards: those listed by the index when there is one, else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not there: {', '.join(missing)}")
        return files
    return sorted(folder.glob("*.safetensors"))


def pickle_files(folder: Path) -> list[Path]:
    """The folder's pickle weight files (``pytorch_model*.bin``, ``*.pt``, ...)."""
    return sorted(p for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES and p.is_file())


def hf_weights(folder: Path, allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the folder's checkpoint, read one at a time.

    The checks run at the call, before any tensor is read.

    :raises PickleCheckpointRefused: the folder has only pickle weights and ``allow_pickle`` is false.
    :raises FileNotFoundError: the folder has no weights at all.
    """
    files = safetensors_files(folder)
    if files:
        return _read_safetensors(files)
    pickles = pickle_files(folder)
    if not pickles:
        raise FileNotFoundError(f"{folder} holds no weights (*.safetensors, or pickle *.bin / *.pt)")
    if not allow_pickle:
        raise PickleCheckpointRefused(
            f"{folder} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}); unpickling can "
            "run arbitrary code, so plinth refuses them by default. Convert the weights to safetensors, or "
            "opt in with allow_pickle=True (they are then read with torch.load(weights_only=True))."
        )
    return _read_pickles(pickles)


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _read_pickles(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        state = torch.load(path, map_location=HOST, weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
        yield from state.items()
