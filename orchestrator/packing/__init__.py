"""Online KV-cache packing: MELL (arXiv 2501.06709, spec `specs/mell.md`) and the packers it is compared with.

Bins are servers with C KV pages each (the replicas of one block segment); items are sessions whose pages only grow.
Every packer implements `Packer`: allocate / depart / update, each giving the moves of running sessions it causes.
- `classes`: size classes L, M, S, T, tiny and the multi-item thresholds;
- `mell`: `MellPacker`, Fig. 10's operations and Theorem 1's properties (`check_invariants`);
- `baselines`: best fit, worst fit, LB (worst fit + Llumnix-style balancing);
- `batching`: one epoch's operations, batched and pruned;
- `live_epoch`: one packer over the servers of a live segment, epoch by epoch, from what they report;
- `migration_split`: each move as a KV transfer or a token replay within link and compute budgets, or deferred;
  the cost model of a move (`MigrationCosts`) and the mode of one move alone (`choose_mode`).
Pure: no I/O, no clocks, no randomness.
"""

from orchestrator.packing.baselines import BestFitPacker, LoadBalancePacker, WorstFitPacker
from orchestrator.packing.batching import Allocate, Depart, EpochPlan, Operation, Update, batch_operations
from orchestrator.packing.classes import SizeClass, size_class
from orchestrator.packing.live_epoch import ReportedSession, SegmentEpoch, SegmentPacking
from orchestrator.packing.mell import MellPacker
from orchestrator.packing.migration_split import (
    Migration,
    MigrationCosts,
    MigrationSplit,
    choose_mode,
    split_migrations,
)
from orchestrator.packing.priority import PriorityWeights
from orchestrator.packing.records import (
    DuplicateItem,
    InvariantViolation,
    Item,
    ItemTooLarge,
    Move,
    NoFreeBin,
    Packer,
    PackingError,
    PagesShrank,
    UnknownItem,
    count_migrations,
)

__all__ = [
    "Allocate",
    "BestFitPacker",
    "Depart",
    "DuplicateItem",
    "EpochPlan",
    "InvariantViolation",
    "Item",
    "ItemTooLarge",
    "LoadBalancePacker",
    "MellPacker",
    "Migration",
    "MigrationCosts",
    "MigrationSplit",
    "Move",
    "NoFreeBin",
    "Operation",
    "Packer",
    "PackingError",
    "PagesShrank",
    "PriorityWeights",
    "ReportedSession",
    "SegmentEpoch",
    "SegmentPacking",
    "SizeClass",
    "UnknownItem",
    "Update",
    "WorstFitPacker",
    "batch_operations",
    "choose_mode",
    "count_migrations",
    "size_class",
    "split_migrations",
]
