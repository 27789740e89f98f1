"""LoRASlots: which adapters the engine holds read in memory, and which of them sit in the model's slots.

- The CPU cache: up to `max_cpu_loras` adapters' weights (LoRAWeights), least recently used evicted first; an
  evicted adapter is read again from its path when a request needs it (its LoRARequest carries the path).
- The slots: `max_loras` places in the model's stacked LoRA matrices. The scheduler asks `can_place` /
  `place` when it admits a request: an adapter already in a slot stays there; otherwise it takes a free slot, or
  the least recently used slot whose adapter no running request uses (`busy`). A request whose adapter cannot be
  placed this step waits. Each placement is a swap the engine core applies before the step's forward
  (`take_swaps` -> executor.set_lora_slot), so the model never changes under a running step.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvflow.lora_request import LoRARequest

NO_SLOT = -1


class LoRASlots:
    def __init__(self, max_loras: int, max_cpu_loras: int, loader: Callable[[LoRARequest], object]):
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.loader = loader                                  # LoRARequest -> LoRAWeights (reads its files)
        self.slots: list[int | None] = [None] * max_loras     # slot -> adapter id
        self.slot_of: dict[int, int] = {}                     # adapter id -> slot
        self.recency: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU slot first
        self.cpu: OrderedDict[int, object] = OrderedDict()   # adapter id -> weights, LRU first
        self.pending: dict[int, object] = {}                  # slot -> weights to write before the next forward
        self.num_loads = 0                                    # adapters read from disk (tests, logs)
        self.num_swaps = 0

    # ---- the CPU cache ---------------------------------------------------------------------------------------
    def weights(self, lora: LoRARequest):
        """The adapter's weights, read from its path unless cached (raises the loader's error, e.g. LoRAAdapterError
        when its files went away)."""
        w = self.cpu.get(lora.lora_int_id)
        if w is not None:
            self.cpu.move_to_end(lora.lora_int_id)
            return w
        w = self.loader(lora)
        self.num_loads += 1
        self.cpu[lora.lora_int_id] = w
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return w

    # ---- the slots -------------------------------------------------------------------------------------------
    def slot(self, lora: LoRARequest | None) -> int:
        if lora is None:
            return NO_SLOT
        return self.slot_of.get(lora.lora_int_id, NO_SLOT)

    def _victim(self, busy: set[int]) -> int | None:
        """The slot a new adapter would take: a free one, else the least recently used one not in `busy` use."""
        for s in self.recency:
            a = self.slots[s]
            if a is None or a not in busy:
                return s
        return None

    def can_place(self, lora: LoRARequest, busy: set[int]) -> bool:
        return lora.lora_int_id in self.slot_of or self._victim(busy) is not None

    def place(self, lora: LoRARequest, busy: set[int]) -> int:
        """The slot of `lora`, swapping it in (at the next step boundary) if it is not resident; `busy`: adapter ids
        running requests use (their slots stay). Raises LookupError when no slot can be had (check can_place), and
        the loader's error when the adapter must be read and cannot be (nothing changed then)."""
        s = self.slot_of.get(lora.lora_int_id)
        if s is None:
            weights = self.weights(lora)
            s = self._victim(busy)
            if s is None:
                raise LookupError(f"no LoRA slot free for {lora.lora_name!r}")
            old = self.slots[s]
            if old is not None:
                del self.slot_of[old]
            self.slots[s] = lora.lora_int_id
            self.slot_of[lora.lora_int_id] = s
            self.pending[s] = weights
        self.recency.move_to_end(s)
        return s

    def forget_slots(self) -> None:
        """The model's slots are empty again (its weights were reloaded after a sleep): every adapter is swapped in
        when a request next needs it; the adapters read stay in the CPU cache."""
        self.slots = [None] * self.max_loras
        self.slot_of = {}
        self.pending = {}

    def take_swaps(self) -> list[tuple[int, object]]:
        """(slot, weights) to write before this step's forward; cleared."""
        swaps = list(self.pending.items())
        self.num_swaps += len(swaps)
        self.pending = {}
        return swaps

    def check(self) -> None:
        for a, s in self.slot_of.items():
            if self.slots[s] != a:
                raise AssertionError(f"LoRA slot {s} holds {self.slots[s]}, the map says {a}")
        if len(self.slot_of) != sum(a is not None for a in self.slots):
            raise AssertionError("LoRA slots and their map disagree")
        if len(self.cpu) > self.max_cpu_loras:
            raise AssertionError(f"{len(self.cpu)} adapters cached, more than max_cpu_loras={self.max_cpu_loras}")
