"""StateCache: a hybrid model's state slots beside the KV blocks — who holds which live slot, the prefix cache's
checkpoints, speculative decoding's snapshots, and the copies the runner makes before each step. The KV cache manager
owns it (`KVCacheManager.state`) and calls it where a request's blocks are taken, reused or freed, so every feature
built on blocks (preemption, prefix caching, aborts) holds for the state too. The runner holds the tensors; the slot
numbers are `runner/state_memory.StateSlotCounts`'.

- A request takes a live slot when admitted and gives it back when it finishes, is aborted or preempted (preemption
  recomputes, as for its KV). Its state starts from zero (the slot is zeroed before its first step) or from a
  checkpoint (copied in: the next token updates the state in place, so a checkpoint is never shared).
- Checkpoints are states at block boundaries, keyed by the key of the block that ends there (the KV blocks' hash
  chain): a prefix-cache hit on a hybrid is the longest run of cached blocks cut back to the last block with a
  checkpoint (vLLM's right-to-left rule; attention KV alone is no use when recurrent layers sit between). A request
  writes one at the last block boundary of its prompt (a repeated prompt starts there) and, where its lookup found
  cached blocks past its checkpoint hit, at the end of those blocks (a shared system prompt's junction: the next
  request that shares it starts there). They are evicted least recently used first, as a slot is needed.
- A speculating request's rows snapshot the state after its last token and after each draft but the last; when a
  draft is rejected the state after the last accepted token is copied back into its live slot before its next step.
"""
from __future__ import annotations

from collections import OrderedDict

from kvflow.request import Request
from kvflow.runner.state_memory import StateSlotCounts


class StateCache:
    def __init__(self, counts: StateSlotCounts, kv_bytes: int):
        self.counts = counts
        self.kv_bytes = kv_bytes                       # the KV blocks' bytes (usage weighs blocks and slots)
        self.live: dict[str, int] = {}                 # request id -> its live slot
        self.free_live = list(range(counts.live - 1, -1, -1))
        self.free_snapshots = list(range(counts.first_snapshot + counts.snapshots - 1, counts.first_snapshot - 1, -1))
        first = counts.first_checkpoint
        self.free_checkpoints = list(range(first + counts.checkpoints - 1, first - 1, -1))
        self.checkpoints: OrderedDict[tuple, int] = OrderedDict()     # block key -> slot, least recently used first
        self.checkpoint_key: dict[int, tuple] = {}
        self.copies: list[tuple[int, int]] = []        # (source slot or -1: zero, slot) before the next step
        # request id -> boundaries (in blocks) where it should leave a checkpoint, found when it was admitted
        self.wanted: dict[str, set[int]] = {}
        # this step's checkpoint writes, registered once its blocks have keys: request id -> [(blocks, slot)]
        self.writing: dict[str, list[tuple[int, int]]] = {}
        self.snapshots: dict[str, list[int]] = {}      # this step's snapshot slots of each speculating request
        self.num_checkpoint_evictions = 0

    # ---- live slots --------------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self.free_live)

    def admit(self, request: Request, checkpoint: int | None) -> None:
        """Give an admitted request a live slot, starting from `checkpoint`'s state (a prefix-cache hit) or zero."""
        slot = self.free_live.pop()
        self.live[request.request_id] = slot
        self.copies.append((-1 if checkpoint is None else checkpoint, slot))

    def slot(self, request_id: str) -> int:
        return self.live[request_id]

    def free(self, request: Request) -> None:
        rid = request.request_id
        slot = self.live.pop(rid, None)
        if slot is None:
            return
        self.free_live.append(slot)
        self.copies = [(src, dst) for src, dst in self.copies if dst != slot]    # none into a slot it left
        self.wanted.pop(rid, None)
        for _, ckpt in self.writing.pop(rid, ()):
            self.free_checkpoints.append(ckpt)
        self.free_snapshots += self.snapshots.pop(rid, ())

    # ---- prefix-cache checkpoints --------------------------------------------------------------------
    def checkpoint_of(self, key: tuple) -> int | None:
        return self.checkpoints.get(key)

    def restore(self, key: tuple) -> int:
        """The slot of the checkpoint a hit restores; it becomes the most recently used."""
        self.checkpoints.move_to_end(key)
        return self.checkpoints[key]

    def want_checkpoints(self, request: Request, boundaries: set[int]) -> None:
        self.wanted[request.request_id] = {b for b in boundaries if b > 0}

    def plan_checkpoints(self, request: Request, start: int, num_new: int, block_size: int) -> list[tuple[int, int]]:
        """This chunk's checkpoint writes: (offset in the chunk, slot) for each wanted boundary it reaches."""
        wanted = self.wanted.get(request.request_id)
        if not wanted or not self.counts.checkpoints:
            return []
        out = []
        for blocks in sorted(wanted):
            end = blocks * block_size
            if start < end <= start + num_new:
                slot = self._take_checkpoint_slot()
                self.writing.setdefault(request.request_id, []).append((blocks, slot))
                out.append((end - 1 - start, slot))
                wanted.discard(blocks)
        return out

    def _take_checkpoint_slot(self) -> int:
        if self.free_checkpoints:
            return self.free_checkpoints.pop()
        key, slot = self.checkpoints.popitem(last=False)      # the least recently used: its copy out (if any
        del self.checkpoint_key[slot]                          # this step) runs before the forward writes it
        self.num_checkpoint_evictions += 1
        return slot

    def register_checkpoints(self, request: Request, key_of_block) -> None:
        """After the step: the checkpoints the request wrote, under the keys their blocks now have (`key_of_block(i)`:
        the key of its i-th block, None if it has none); a key that already has one keeps it."""
        for blocks, slot in self.writing.pop(request.request_id, ()):
            key = key_of_block(blocks - 1)
            if key is None or key in self.checkpoints:
                self.free_checkpoints.append(slot)
                continue
            self.checkpoints[key] = slot
            self.checkpoint_key[slot] = key

    def reset(self) -> None:
        """Drop every checkpoint (reset_prefix_cache)."""
        for slot in self.checkpoints.values():
            self.free_checkpoints.append(slot)
        self.checkpoints.clear()
        self.checkpoint_key.clear()

    # ---- speculative decoding's snapshots ---------------------------------------------------------------
    def take_snapshots(self, request: Request, num_drafts: int) -> list[int] | None:
        """Slots for the states after a speculating request's last token and each draft but the last (None: not
        enough free: it does not speculate this step)."""
        if num_drafts > len(self.free_snapshots):
            return None
        slots = [self.free_snapshots.pop() for _ in range(num_drafts)]
        self.snapshots[request.request_id] = slots
        return slots

    def accepted(self, request: Request, num_accepted: int, num_drafts: int) -> None:
        """After verification: unless every draft was accepted, the live state holds rejected tokens; the state after
        the last accepted one comes back from its snapshot before the request's next step."""
        slots = self.snapshots.pop(request.request_id, [])
        if num_accepted < num_drafts and request.request_id in self.live:
            self.copies.append((slots[num_accepted], self.live[request.request_id]))
        self.free_snapshots += slots

    # ---- the step ------------------------------------------------------------------------------------
    def take_copies(self) -> tuple[tuple[int, int], ...]:
        copies, self.copies = tuple(self.copies), []
        return copies

    @property
    def usage_bytes(self) -> int:
        return len(self.live) * self.counts.slot_bytes

    def check(self) -> None:
        """Raise AssertionError unless the idle invariant holds: no live slot held, every slot accounted for."""
        if self.live:
            raise AssertionError(f"requests still hold state slots: {sorted(self.live)}")
        if len(self.free_live) != self.counts.live or len(set(self.free_live)) != self.counts.live:
            raise AssertionError(f"{len(self.free_live)} of {self.counts.live} live state slots free")
        if len(self.free_snapshots) != self.counts.snapshots:
            raise AssertionError(f"{len(self.free_snapshots)} of {self.counts.snapshots} snapshot slots free")
        held = len(self.free_checkpoints) + len(self.checkpoints)
        if held != self.counts.checkpoints or self.writing:
            raise AssertionError(f"checkpoint slots: {len(self.free_checkpoints)} free + {len(self.checkpoints)} "
                                 f"cached != {self.counts.checkpoints}, or writes pending: {sorted(self.writing)}")
        for key, slot in self.checkpoints.items():
            if self.checkpoint_key.get(slot) != key:
                raise AssertionError(f"checkpoint map and slot {slot} disagree")
