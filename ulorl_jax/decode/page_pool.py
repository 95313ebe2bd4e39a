"""Host-side bookkeeping of a paged KV cache (models/paged_kv.py): which slot owns which pages.

The engine asks for pages before every call that writes to the cache (`grow`: enough for the positions
the call may write), gives them back when a sample ends or is preempted (`release`), and ships the page
table of the slots' pages to the device with each call (`table`), always a slot's most pages wide: one
shape, so no call compiles again as samples grow (the attention's work does not depend on the width: the
XLA path reads the pool once, the Pallas kernel skips pages past each slot's length).
"""

from __future__ import annotations

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    return -(-int(tokens) // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, slots: int, max_pages_per_slot: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("slots", slots),
                        ("max_pages_per_slot", max_pages_per_slot)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_pages_per_slot = int(max_pages_per_slot)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self._owned: list[list[int]] = [[] for _ in range(int(slots))]
        self.peak_used = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def owned(self, slot: int) -> list[int]:
        return list(self._owned[slot])

    def shortfall(self, slot: int, tokens: int) -> int:
        """Pages `slot` still needs to hold `tokens` positions (0 if it has them)."""
        want = min(pages_for(tokens, self.page_size), self.max_pages_per_slot)
        return max(0, want - len(self._owned[slot]))

    def grow(self, slot: int, tokens: int) -> bool:
        """Give `slot` pages for `tokens` positions; False (and nothing taken) when too few are free."""
        need = self.shortfall(slot, tokens)
        if need > len(self._free):
            return False
        self._owned[slot] += [self._free.pop() for _ in range(need)]
        self.peak_used = max(self.peak_used, self.used_pages)
        return True

    def release(self, slot: int) -> None:
        self._free += self._owned[slot][::-1]
        self._owned[slot] = []

    def table(self) -> np.ndarray:
        """[slots, max_pages_per_slot] int32: each slot's pages in order, then `num_pages` (no page). Always
        this wide: a table as wide as the longest sample would be a new shape, and so a compile of the
        prefill and decode steps, each time the longest sample crosses a power of two of pages."""
        width = self.max_pages_per_slot
        out = np.full((len(self._owned), width), self.num_pages, np.int32)
        for slot, pages in enumerate(self._owned):
            out[slot, :len(pages)] = pages[:width]
        return out
