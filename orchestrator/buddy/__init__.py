"""KunServe's parameter dropping as pure policies (arXiv 2412.18169 v2, spec `specs/kunserve.md`).

Under a KV burst, servers hosting the same segment merge into buddy groups; each member keeps a contiguous slice of
the segment, the group still holds one copy and serves it as a pipeline, and the dropped blocks' parameter pages hold
KV at once. The live servers, the orchestrator and the simulator call the same functions:
- `triggers`: when to drop (`drop_trigger`, Sec. 3.1's 1-s forecast) and when to restore (`restore_trigger`,
  with hysteresis and a calm window), and how many old demand samples a caller may forget (`stale_count`);
- `groups`: Alg. 1 and its balanced variant (`plan_buddy_groups`), the slices each member keeps (`slice_group`),
  the whole plan of a segment (`plan_drop`), Alg. 1 continued from groups formed earlier (`plan_merge`) and the
  invariants of a plan (`check_plan`);
- `exchange`: the victims' moves of a plan (`victim_moves`), their order and their mode (`exchange_mode`), and the
  pages each member holds back for the KV its mates' victims bring (`incoming_pages`).
Pure: no I/O, no clocks, no randomness.
"""

from orchestrator.buddy.exchange import (
    ExchangeMode,
    VictimMove,
    exchange_mode,
    exchange_order,
    incoming_pages,
    victim_moves,
)
from orchestrator.buddy.groups import (
    check_plan,
    groups_of,
    plan_buddy_groups,
    plan_drop,
    plan_merge,
    segments,
    slice_group,
)
from orchestrator.buddy.records import BuddyGroup, DropPlan, PlanError, PlanViolation, SegmentReplica
from orchestrator.buddy.triggers import (
    RESTORE_CALM_S,
    Samples,
    drop_trigger,
    latest_rate,
    restore_trigger,
    stale_count,
)

__all__ = [
    "RESTORE_CALM_S",
    "BuddyGroup",
    "DropPlan",
    "ExchangeMode",
    "PlanError",
    "PlanViolation",
    "Samples",
    "SegmentReplica",
    "VictimMove",
    "check_plan",
    "drop_trigger",
    "exchange_mode",
    "exchange_order",
    "groups_of",
    "incoming_pages",
    "latest_rate",
    "plan_buddy_groups",
    "plan_drop",
    "plan_merge",
    "restore_trigger",
    "segments",
    "slice_group",
    "stale_count",
    "victim_moves",
]
