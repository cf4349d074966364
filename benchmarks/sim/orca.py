"""Orca on the modelled clock: level 2's iteration-level scheduling over contiguous reservations.

What it is: the PagedAttention paper's Orca baselines, built from the simulated level 2
(engines.py) with only the KV memory replaced:

    ReservingKVCacheManager   a request reserves one contiguous region at admission and holds it
                              to the end, placed first fit in one address space (`first_fit`):
                              freed regions leave holes a larger request cannot use
    SimulatedOrca             level 2's scheduler over it; `reserve` sizes the region: the model's
                              maximum (Orca Max), the next power of two of the true length (Pow2,
                              `next_power_of_two`), or the true length (Oracle)

Lab 2b has the student write `next_power_of_two`, `first_fit` and `reserve`.

What it is not: Orca itself (it is not public; the paper, too, built its Orca from its own
system's parts) or a model of its kernels: the cost is cost.py's, as for every simulated system.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), section 6.1; Yu et al., "Orca" (OSDI 2022).
"""

from __future__ import annotations

from level2_continuous.request import Request

from .engines import SimulatedContinuous


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


class ReservingKVCacheManager:
    """Orca's memory: a request reserves one contiguous region at admission and holds it to the end.

    Counted in tokens (block size 1: a region has no blocks), placed first-fit in one address space
    [0, capacity), so freed regions leave holes a larger request cannot use (external fragmentation).
    `reserve(req)` is the region's size: the model's maximum (Orca Max), the next power of two of the
    true length (Pow2), or the true length (Oracle). Nothing is ever preempted: the region covers the
    request."""

    block_size = 1

    def __init__(self, capacity_tokens: int, reserve):
        self.num_blocks, self.reserve = capacity_tokens, reserve
        self.regions: dict[int, tuple[int, int]] = {}  # seq_id -> (start, size)
        self.stored: dict[int, int] = {}
        self.num_reserved = self.num_stored = 0

    def first_fit(self, size: int, keep_free: int = 0) -> int | None:
        """The lowest start of a hole of `size` tokens, or None (also None if fewer than `keep_free`
        tokens would be left free in all)."""
        if self.num_blocks - self.num_reserved - size < keep_free:
            return None
        at = 0
        for start, length in sorted(self.regions.values()):
            if start - at >= size:
                return at
            at = start + length
        return at if self.num_blocks - at >= size else None

    def get_computed_blocks(self, req: Request) -> tuple[list, int]:
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list | None = None,
                       keep_free: int = 0) -> bool:  # fmt: skip
        if req.seq_id not in self.regions:
            size = self.reserve(req)
            start = self.first_fit(size, keep_free)
            if start is None:
                return False
            self.regions[req.seq_id] = (start, size)
            self.num_reserved += size
        if req.num_computed_tokens + num_new_tokens > self.regions[req.seq_id][1]:
            raise RuntimeError(f"request {req.request_id} outgrew its reservation (the reservation rule is wrong)")
        return True

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        self.num_stored += n - self.stored.get(req.seq_id, 0)
        self.stored[req.seq_id] = n

    def free(self, req: Request) -> None:
        self.num_reserved -= self.regions.pop(req.seq_id, (0, 0))[1]
        self.num_stored -= self.stored.pop(req.seq_id, 0)

    def block_table(self, req: Request) -> list[int]:
        return []

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_reserved

    def usage(self) -> tuple[int, int]:
        return self.num_reserved, self.num_stored

    def ref_counts(self) -> list[int]:
        return []

    def cached_free_blocks(self) -> list[int]:
        return []


ORCA_RESERVATIONS = ("max", "pow2", "oracle")


class SimulatedOrca(SimulatedContinuous):
    """Orca: level 2's iteration-level scheduling with contiguous reservations (`reservation`)."""

    def __init__(self, model: str, *, reservation: str = "oracle", **kwargs):
        if reservation not in ORCA_RESERVATIONS:
            raise ValueError(f"reservation={reservation!r} is not one of {ORCA_RESERVATIONS}")
        self.reservation = reservation
        super().__init__(model, block_size=1, **kwargs)

    def reserve(self, req: Request) -> int:
        """The region a request reserves at admission, by `self.reservation` (see the class docstring)."""
        true = len(req.prompt_token_ids) + self.targets[req.request_id]
        if self.reservation == "max":
            return req.max_total_tokens  # what the request may grow to: prompt + max_tokens
        return min(next_power_of_two(true), req.max_total_tokens) if self.reservation == "pow2" else true

    def make_kv_manager(self) -> ReservingKVCacheManager:
        return ReservingKVCacheManager(self.num_blocks, self.reserve)
