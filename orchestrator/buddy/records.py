"""What KunServe's policies read and give: a server's view of one hosted segment, buddy groups, a drop plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class PlanError(ValueError):
    """A drop plan was asked of replicas it cannot be made of (different segments, the same server twice)."""


class PlanViolation(AssertionError):
    """A drop plan breaks one of its invariants (`check_plan`)."""


@dataclass(frozen=True)
class SegmentReplica:
    """One server hosting the whole segment [block_start, block_end), as its record announces it.

    `params_pages_per_block` is what dropping one of its blocks frees; `tau_p_ms` its time per block (a decode step,
    one session), which sets how many blocks it keeps when slices follow speed; `draining` servers are leaving and
    take part in no plan."""

    peer_id: str
    block_start: int
    block_end: int
    params_pages_per_block: int
    pages_free: int = 0
    pages_kv: int = 0
    tau_p_ms: float = 1.0
    tau_c_ms: float = 0.0
    draining: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.block_start < self.block_end:
            raise PlanError(f"{self.peer_id}: an empty or negative block range [{self.block_start}, {self.block_end})")
        if self.params_pages_per_block < 1:
            raise PlanError(f"{self.peer_id}: params_pages_per_block must be >= 1, got {self.params_pages_per_block}")
        if self.tau_p_ms <= 0:
            raise PlanError(f"{self.peer_id}: tau_p_ms must be > 0, got {self.tau_p_ms}")

    @property
    def segment(self) -> tuple[int, int]:
        return self.block_start, self.block_end

    @property
    def blocks(self) -> int:
        return self.block_end - self.block_start

    @property
    def params_pages(self) -> int:
        """P of Alg. 1: the pages of the whole segment's parameters on this server."""
        return self.blocks * self.params_pages_per_block


@dataclass(frozen=True)
class BuddyGroup:
    """Servers that host the same segment and serve it together as a pipeline, member r keeping the r-th slice."""

    members: tuple[str, ...]  # in slice order: a session enters at members[0]
    block_start: int
    block_end: int

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class DropPlan:
    """Which server keeps which blocks of a segment, and the pages each frees.

    `kept` maps every server of the plan to the range it keeps; a member of a group of one keeps the whole segment.
    `epoch` orders plans, so that members agreeing over the DHT can tell a newer plan from an older one."""

    block_start: int
    block_end: int
    groups: tuple[BuddyGroup, ...]
    kept: Mapping[str, tuple[int, int]]
    freed_pages: Mapping[str, int]
    required_pages: int
    epoch: int = 0
    dropped: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    @property
    def total_freed_pages(self) -> int:
        return sum(self.freed_pages.values())

    @property
    def meets_requirement(self) -> bool:
        """Whether the plan frees the pages it was asked for; when not, scaling out is left (Sec. 4.3)."""
        return self.total_freed_pages >= self.required_pages

    @property
    def changes_anything(self) -> bool:
        return any(group.size > 1 for group in self.groups)

    def group_of(self, peer_id: str) -> BuddyGroup:
        """Gives the group `peer_id` belongs to."""
        for group in self.groups:
            if peer_id in group.members:
                return group
        raise KeyError(peer_id)
