"""The page pool's bookkeeping, on the host: which KV pages each decode slot holds.

One pool per data replica (its pages are `[kv_heads, pages, page_size, head_dim]` per layer on the
devices, model/paged_attention.py); this table says which of them belong to which slot, so the
device only ever sees a page table (`[slots, max_pages]` int32) and lengths. It lives where the
slot table lives, which already knows every slot's length.

  - Page 0 is the null page: never handed out, it fills table entries past a slot's pages so
    every gather reads a valid page.
  - A slot reserves the page its next token goes to one step ahead (`reserve`), so a decode step
    never needs a page that is not there.
  - A group's G slots share their prompt's full pages (refcounted); from the last, partial page
    on each member has pages of its own (`share`), since each writes its own tokens there.
  - Admission is by free pages (`can_admit`): a request waits until its prompt and first token
    fit. When the pool runs dry mid-decode, the slot with the least progress is preempted
    (`preempt_victim`): it gives back its pages, keeps its tokens, and is prefilled again later.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from magistral_jax.model.paged_attention import NULL_PAGE, pages_for


class OutOfPages(RuntimeError):
  """The pool has fewer free pages than asked for: preempt a slot (preempt_victim) and retry."""


@dataclasses.dataclass
class PagePool:
  """Page ownership for one pool of `num_pages` pages of `page_size` positions (page 0 null)."""
  num_pages: int
  page_size: int
  max_pages_per_slot: int

  def __post_init__(self):
    if self.num_pages < 2 or self.page_size < 1 or self.max_pages_per_slot < 1:
      raise ValueError(f"page pool needs >= 2 pages, page_size >= 1 and max_pages_per_slot >= 1, "
                       f"got {self.num_pages}, {self.page_size}, {self.max_pages_per_slot}")
    self._free = list(range(self.num_pages - 1, 0, -1))   # pop() hands out low pages first
    self._refs = np.zeros(self.num_pages, np.int32)
    self._slots: dict[int, list[int]] = {}
    self.preemptions = 0

  # -------------------------------------------------------------------------- queries
  @property
  def free_pages(self) -> int:
    return len(self._free)

  @property
  def used_pages(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def pages_for(self, length: int) -> int:
    return pages_for(int(length), self.page_size)

  def pages_of(self, slot: int) -> list[int]:
    return list(self._slots.get(slot, ()))

  def can_admit(self, prompt_len: int, shared_pages: int = 0) -> bool:
    """Whether a prompt of `prompt_len` tokens plus its first new token fits, of which
    `shared_pages` full pages are already held by a group mate."""
    need = self.pages_for(prompt_len + 1) - shared_pages
    return need <= len(self._free) and self.pages_for(prompt_len + 1) <= self.max_pages_per_slot

  def table(self, slots: int) -> np.ndarray:
    """The page table [slots, max_pages_per_slot] the device reads (null past each slot's)."""
    t = np.full((slots, self.max_pages_per_slot), NULL_PAGE, np.int32)
    for s, pages in self._slots.items():
      if s < slots:
        t[s, :len(pages)] = pages
    return t

  # -------------------------------------------------------------------------- changes
  def _take(self, n: int) -> list[int]:
    if n > len(self._free):
      raise OutOfPages(f"{n} page(s) asked, {len(self._free)} free of {self.num_pages - 1}")
    got = [self._free.pop() for _ in range(n)]
    self._refs[got] += 1
    return got

  def _give(self, pages: list[int]):
    for p in pages:
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)

  def admit(self, slot: int, length: int) -> list[int]:
    """Pages for a slot's first `length` positions (its prompt and its first new token)."""
    if slot in self._slots:
      raise ValueError(f"slot {slot} already holds pages; release it first")
    n = self.pages_for(length)
    if n > self.max_pages_per_slot:
      raise ValueError(f"{length} positions need {n} pages, more than a slot's "
                       f"{self.max_pages_per_slot}")
    self._slots[slot] = self._take(n)
    return list(self._slots[slot])

  def share(self, src: int, dst: int, prompt_len: int, reserve: int = 1) -> list[int]:
    """Slot `dst` takes `src`'s prompt: its full pages by reference, and pages of its own from
    the last, partial one on (with room for `reserve` new tokens), since each member writes its
    own tokens there. The engine writes the prompt's row into every member's pages (the shared
    ones get the values they hold again), so no page is copied. Returns dst's pages."""
    if dst in self._slots:
      raise ValueError(f"slot {dst} already holds pages; release it first")
    full = prompt_len // self.page_size
    shared = self._slots[src][:full]
    own = self._take(self.pages_for(prompt_len + reserve) - full)
    self._refs[shared] += 1
    self._slots[dst] = shared + own
    return list(self._slots[dst])

  def reserve(self, slot: int, length: int) -> list[int]:
    """Grows `slot` to hold `length` positions (the next step's token included); the new pages.
    Raises OutOfPages when the pool cannot, and ValueError past the slot's table."""
    pages = self._slots[slot]
    n = self.pages_for(length) - len(pages)
    if n <= 0:
      return []
    if len(pages) + n > self.max_pages_per_slot:
      raise ValueError(f"slot {slot}: {length} positions need more than its "
                       f"{self.max_pages_per_slot} pages")
    got = self._take(n)
    pages.extend(got)
    return got

  def release(self, slot: int) -> int:
    """Gives back every page `slot` holds (shared ones when their last holder goes)."""
    pages = self._slots.pop(slot, [])
    self._give(pages)
    return len(pages)

  def preempt_victim(self, progress: dict[int, int]) -> int | None:
    """The slot to preempt when pages run out: the one with the fewest generated tokens (the
    least work lost; ties to the highest slot, the most recently filled), among `progress`'s."""
    held = [s for s in progress if s in self._slots]
    if not held:
      return None
    return min(held, key=lambda s: (progress[s], -s))

  def preempt(self, slot: int) -> int:
    """Releases a preempted slot's pages and counts it."""
    self.preemptions += 1
    return self.release(slot)

  def check(self):
    """Every page is free xor referenced by the slots that hold it (a test and debug aid)."""
    refs = np.zeros(self.num_pages, np.int32)
    for pages in self._slots.values():
      np.add.at(refs, pages, 1)
    free = np.zeros(self.num_pages, bool)
    free[self._free] = True
    if refs[NULL_PAGE] or free[NULL_PAGE]:
      raise AssertionError("the null page was handed out")
    if not np.array_equal(refs, self._refs) or np.any(free[1:] == (refs[1:] > 0)):
      raise AssertionError("page refcounts and the free list disagree")
