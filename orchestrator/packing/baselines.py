"""The packers MELL is compared with (Sec. VIII-B): BF (best fit), WF (worst fit) and LB (worst fit + balancing).

All three place an arriving session on an active bin where it fits (BF: the one with the fewest free pages that
suffice; WF: the one with the most), open a new bin when none fits, and release a bin when it empties. BF and WF
never migrate on their own. LB is Llumnix's load balancing on top of WF: after every operation it moves sessions
from the fullest active bin to the emptiest while their free-page gap exceeds `gap_threshold_pages`.

Rules the paper does not give, chosen here:
- A session whose growth overflows its bin moves to the bin its packer's rule picks for it, its own bin excluded: the
  one migration that keeps capacity (the paper does not say what BF and WF do on growth). With sizes reserved at
  admission (the simulator's `reserve_final`, which `benchmarks/mell_sim.py` gives BF and WF so that they never
  migrate, as the paper's do) no session grows and this never happens; growing on demand, BF and WF are stronger
  than the paper's (mell_sim's "bf+moves" and "wf+moves").
- LB moves the largest session of the fullest bin with at most half the gap (so the gap shrinks and never flips, and
  the loop ends), ties by session id; it stops when no session qualifies, and an operation causes at most
  `max_moves_per_operation` moves in all (default 10, MELL's bound). The default threshold is C/4.
- Ties between bins go to the smallest bin id.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.packing.bins import BinPacker
from orchestrator.packing.records import Item


class _FitPacker(BinPacker):
    """A packer that places each session on its own, by a fit rule over the active bins' free pages."""

    def _allocate(self, item: Item) -> None:
        self._state.add_unit(item.item_id, {item.item_id: item.pages})
        self._state.put(item.item_id, self._choose(item.pages, None))
        self._after_operation()

    def _depart(self, item_id: str) -> None:
        bin_id = self._state.bin_of(item_id)
        self._state.remove_session(item_id)
        self._state.release_if_empty(bin_id)
        self._after_operation()

    def _update(self, item_id: str, new_pages: int) -> None:
        state = self._state
        state.set_pages(item_id, new_pages)
        bin_id = state.bin_of(item_id)
        if state.loads[bin_id] > state.capacity_pages:
            state.take(item_id)
            state.put(item_id, self._choose(new_pages, bin_id))
        self._after_operation()

    def _choose(self, pages: int, exclude: str | None) -> str:
        state = self._state
        fitting = [b for b in state.active_bins() if b != exclude and state.free(b) >= pages]
        return self._pick(fitting) if fitting else state.activate()

    def _pick(self, fitting: list[str]) -> str:
        raise NotImplementedError

    def _after_operation(self) -> None:
        """Runs after every operation (LB balances here)."""


class BestFitPacker(_FitPacker):
    """BF: each arriving session goes to the active bin with the fewest free pages that suffice; no migration."""

    name = "bf"

    def _pick(self, fitting: list[str]) -> str:
        return min(fitting, key=lambda b: (self._state.free(b), b))


class WorstFitPacker(_FitPacker):
    """WF: each arriving session goes to the active bin with the most free pages; no migration."""

    name = "wf"

    def _pick(self, fitting: list[str]) -> str:
        return min(fitting, key=lambda b: (-self._state.free(b), b))


class LoadBalancePacker(WorstFitPacker):
    """LB: worst fit, then Llumnix-style moves from the fullest to the emptiest bin while their gap is too wide."""

    name = "lb"

    def __init__(
        self,
        bin_ids: Sequence[str],
        capacity_pages: int,
        gap_threshold_pages: int | None = None,
        max_moves_per_operation: int = 10,
    ) -> None:
        super().__init__(bin_ids, capacity_pages)
        self.gap_threshold_pages = capacity_pages // 4 if gap_threshold_pages is None else gap_threshold_pages
        if self.gap_threshold_pages < 0 or max_moves_per_operation < 0:
            raise ValueError("the gap threshold and the move limit must be >= 0")
        self.max_moves_per_operation = max_moves_per_operation

    def _after_operation(self) -> None:
        state = self._state
        for _ in range(self.max_moves_per_operation - len(state.log.origin)):
            active = state.active_bins()
            if len(active) < 2:
                return
            fullest = min(active, key=lambda b: (state.free(b), b))
            emptiest = min(active, key=lambda b: (-state.free(b), b))
            gap = state.free(emptiest) - state.free(fullest)
            if gap <= self.gap_threshold_pages:
                return
            movable = [s for s in state.sessions_on(fullest) if 0 < 2 * state.pages[s] <= gap]
            if not movable:
                return
            session_id = min(movable, key=lambda s: (-state.pages[s], s))
            state.take(session_id)
            state.put(session_id, emptiest)
