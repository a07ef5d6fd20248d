"""The engine's LoRA adapters: names, slots, the requests using each, and each step's LoRA batch.

Adapters are loaded into the model's pre-allocated slots (:mod:`plinth.model.lora`). Each loaded
adapter gets a ``lora_id`` the scheduler carries (an int minted here and never reused in the
process, so a prefix-cache block of an unloaded adapter can never match a later one's) and a slot
the runner maps it to.

Unloading an adapter that running requests use removes its name at once (new requests can no
longer select it) and frees its slot when the last of those requests ends.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plinth.model.config import ModelConfig
from plinth.model.lora import LoRAAdapterError, PeftAdapter, clear_slot, read_peft_adapter, write_adapter
from plinth.platform.lora import LoRABatch, LoRAKernels
from plinth.runtime.parts import InvalidRequest
from plinth.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)


class LoRAError(InvalidRequest):
    """An adapter operation the engine refuses (bad folder, duplicate name, no free slot, unknown
    name); ``param`` names the field at fault. Nothing changed; requests keep running."""


@dataclass(slots=True)
class LoRAAdapter:
    """One loaded adapter: its name, folder, id, slot and how many live requests use it."""

    name: str
    path: str
    lora_id: int
    slot: int
    adapter: PeftAdapter
    users: int = 0
    unloading: bool = False  # removed by name; the slot frees when ``users`` reaches 0

    @property
    def rank(self) -> int:
        """The adapter's rank ``r``."""
        return self.adapter.rank


@dataclass(frozen=True, slots=True)
class LoRAPlace:
    """Rank 0 to the tensor-parallel workers, between steps: load the adapter in folder ``path`` as
    ``lora_id`` into ``slot`` (each rank its own slice of it)."""

    name: str
    path: str
    lora_id: int
    slot: int


@dataclass(frozen=True, slots=True)
class LoRAEvict:
    """Rank 0 to the workers, between steps: adapter ``lora_id``'s slot is free (clear it)."""

    lora_id: int


class LoRAManager:
    """Loads, names and unloads adapters, and builds each step's LoRA batch.

    Under tensor parallelism rank 0's manager decides (names, ids, slots, when a slot frees) and
    ``announce`` sends each decision to the workers (:class:`LoRAPlace`, :class:`LoRAEvict`), whose
    managers :meth:`apply` it to their own shards between the same two steps.

    :param model: the loaded model, with slots already attached (:func:`plinth.model.lora.attach_lora`).
    :param op: the batched LoRA op the slots use.
    :param model_config: the whole model's shape (to check adapters against; a rank slices them).
    :param device: where the step's slot indices live.
    :param announce: rank 0 of a tensor-parallel world: sends a decision to the workers.
    """

    def __init__(
        self,
        model: Any,
        op: LoRAKernels,
        model_config: ModelConfig,
        device: torch.device,
        announce: Callable[[LoRAPlace | LoRAEvict], None] | None = None,
    ) -> None:
        self.model = model
        self.op = op
        self.spec = op.spec
        self.model_config = model_config
        self.device = device
        self.announce = announce
        self._by_name: dict[str, LoRAAdapter] = {}
        self._by_id: dict[int, LoRAAdapter] = {}  # also the unloading ones, until their slot frees
        self._free_slots = list(range(self.spec.max_loras))
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load the PEFT adapter in folder ``path`` under ``name`` into a free slot.

        :raises LoRAError: an empty or duplicate name (``lora_name``), no free slot, or a folder
            that does not hold an adapter plinth can serve (the field at fault named).
        """
        if not isinstance(name, str) or not name:
            raise LoRAError("a LoRA adapter needs a non-empty name", param="lora_name")
        if name in self._by_name:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        if not self._free_slots:
            raise LoRAError(
                f"no free LoRA slot: {self.spec.max_loras} adapters are loaded (max_loras); unload one first",
                param="lora_name",
            )
        try:
            adapter = read_peft_adapter(path, self.model_config, self.spec.max_rank)
        except LoRAAdapterError as exc:
            field = exc.field if exc.field == "lora_path" else f"lora_path ({exc.field})"
            raise LoRAError(str(exc), param=field) from None
        slot = self._free_slots.pop(0)
        write_adapter(self.model, slot, adapter)
        loaded = LoRAAdapter(name, str(path), next(self._ids), slot, adapter)
        self._by_name[name] = loaded
        self._by_id[loaded.lora_id] = loaded
        logger.info("LoRA adapter %r loaded from %s into slot %d (rank %d)", name, path, slot, adapter.rank)
        if self.announce is not None:
            self.announce(LoRAPlace(name, str(path), loaded.lora_id, slot))
        return loaded

    def apply(self, decision: LoRAPlace | LoRAEvict) -> None:
        """A worker rank: carry out rank 0's decision on this rank's shard.

        :raises LoRAError: the folder does not hold the adapter rank 0 read (not the same files on
            this node): the rank cannot serve it, and fails.
        """
        if isinstance(decision, LoRAEvict):
            loaded = self._by_id.pop(decision.lora_id)
            clear_slot(self.model, loaded.slot, loaded.adapter)
            return
        try:
            adapter = read_peft_adapter(decision.path, self.model_config, self.spec.max_rank)
        except LoRAAdapterError as exc:
            raise LoRAError(f"LoRA adapter {decision.name!r} at {decision.path}: {exc}", param="lora_path") from None
        write_adapter(self.model, decision.slot, adapter)
        self._by_id[decision.lora_id] = LoRAAdapter(
            decision.name, decision.path, decision.lora_id, decision.slot, adapter
        )

    def remove(self, name: str) -> None:
        """Unload adapter ``name``: at once if no request uses it, else when the last one ends.

        :raises LoRAError: no adapter of that name is loaded.
        """
        loaded = self._by_name.pop(name, None)
        if loaded is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        loaded.unloading = True
        if loaded.users == 0:
            self._free(loaded)
        else:
            logger.info("LoRA adapter %r unloaded: its slot frees when its %d requests end", name, loaded.users)

    def _free(self, loaded: LoRAAdapter) -> None:
        clear_slot(self.model, loaded.slot, loaded.adapter)
        self._by_id.pop(loaded.lora_id, None)
        self._free_slots.append(loaded.slot)
        self._free_slots.sort()
        if self.announce is not None:
            self.announce(LoRAEvict(loaded.lora_id))

    def names(self) -> list[str]:
        """The names of the loaded adapters (in load order)."""
        return list(self._by_name)

    def get(self, name: str) -> LoRAAdapter | None:
        """The loaded adapter called ``name``, or None."""
        return self._by_name.get(name)

    def acquire(self, name: str) -> int:
        """A new request uses adapter ``name``: its ``lora_id``.

        :raises LoRAError: no adapter of that name is loaded (``param`` "lora").
        """
        loaded = self._by_name.get(name)
        if loaded is None:
            known = ", ".join(repr(n) for n in self._by_name) or "none"
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {known})", param="lora")
        loaded.users += 1
        return loaded.lora_id

    def release(self, lora_id: int) -> None:
        """A request that used ``lora_id`` ended (finished or aborted)."""
        loaded = self._by_id.get(lora_id)
        if loaded is None:
            return
        loaded.users -= 1
        if loaded.unloading and loaded.users == 0:
            self._free(loaded)

    def batch(self, scheduled: Sequence[ScheduledChunk[Any]]) -> LoRABatch | None:
        """The step's LoRA batch (each token's slot, -1: none), or None when no chunk has an adapter."""
        if not any(c.lora_id for c in scheduled):
            return None
        by_id = self._by_id
        slots: list[int] = []
        for c in scheduled:
            slot = by_id[c.lora_id].slot if c.lora_id else -1
            slots.extend([slot] * len(c.token_ids))
        return self.op.prepare_batch(slots, self.device)


def build_lora(
    config: Any,
    model: Any,
    lora_kernels: Any,
    dtype: str,
    device: torch.device,
    model_config: ModelConfig,
    announce: Callable[[LoRAPlace | LoRAEvict], None] | None = None,
) -> LoRAManager:
    """Attach adapter slots to ``model`` (this rank's shard: its slots are its slices' shapes) for
    ``config`` (``max_loras``, ``max_lora_rank``) and return their manager; ``lora_kernels`` is the
    kernel set's factory (``KernelSet.lora``), ``model_config`` the whole model's shape."""
    from plinth.model.lora import attach_lora
    from plinth.platform.values import LoRASpec

    spec = LoRASpec(max_loras=config.max_loras, max_rank=config.max_lora_rank, dtype=dtype)
    op = lora_kernels(spec)
    attach_lora(model, op, spec)
    return LoRAManager(model, op, model_config, device, announce)
