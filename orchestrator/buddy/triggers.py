"""When to drop and when to restore (Sec. 4.3, spec 3.1 and 5.6), from samples of KV demand and available pages.

Times are passed in with the samples; nothing here reads a clock.

Drop: the monitor forecasts one horizon (Delta = 1 s, deliberately tight: a drop is instant, a false one costs
pipeline hops) with the latest rate of each series and asks for a plan when demand meets what is available:
    D + Delta * D' >= A + Delta * A'   ->   R = (D + Delta * D') - (A + Delta * A')  pages, rounded up
D is the pages the running sessions hold plus those asked by sessions that had to wait (Llumnix's head-of-line
demand), A the pages that can hold KV (held by KV plus free). The spec reads R as D + Delta * D' - A; R here is the
shortfall against the forecast A instead, so that a drop is asked exactly when the trigger fires [chainswarm].

Restore, with hysteresis [chainswarm, spec 5.6]: when the demand forecast over 5 s fits in 50% of the KV capacity the
servers would have with every block back (the spec's 80% is above the demand a drop may fire at: the drop trigger
forecasts one horizon ahead, so a group of two servers holding four sessions dropped at 3 sessions' demand, restored
at the same demand in the lull and dropped again; 50% is KunServe's code's `restore_memory_threshold`), and the drop
is at least 10 s old. Beyond the spec, the demand must also have stayed within those 50% for the last 15 s (a calm
window, as autoscalers keep before they scale down). Without it, most kept live runs of the code trace's burst
restored in the lull between its two waves (the spec's rule holds there: the demand fell to a few sessions) and
dropped again 1.5-10 s later, an exchange of victims each time; their demand replayed through a 15-s window restores
after the burst in all 27 arm-runs (docs/architecture.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Samples = Sequence[tuple[float, int]]  # (time_s, pages), oldest first

DROP_HORIZON_S = 1.0
RESTORE_HORIZON_S = 5.0
RESTORE_FILL = 0.5  # of the undropped KV capacity the forecast demand may use for a restore (KunServe's code:
# restore_memory_threshold 0.5; the spec's 0.8 left one session of hysteresis on r23's and r24's pools of four,
# whose group restored in the burst's lull at the demand it had dropped at, and dropped again 1-4 s later)
RESTORE_MIN_DROPPED_S = 10.0
RESTORE_CALM_S = 15.0  # the demand stayed within RESTORE_FILL of the undropped capacity this long


def stale_count(samples: Samples, keep_s: float) -> int:
    """Gives how many of the oldest samples the caller may delete while the rest still reach back `keep_s` before the
    newest (the last sample at or before that moment stays) and the newest two stay (a rate needs them)."""
    if len(samples) <= 2:
        return 0
    cutoff_s = samples[-1][0] - keep_s
    before = [index for index, (time_s, _) in enumerate(samples) if time_s <= cutoff_s]
    return min(before[-1] if before else 0, len(samples) - 2)


def latest_rate(samples: Samples) -> float:
    """Gives the change per second between the last two samples (0 with fewer than two, or no time between them)."""
    if len(samples) < 2:
        return 0.0
    (before_s, before), (now_s, now) = samples[-2], samples[-1]
    if now_s <= before_s:
        return 0.0
    return (now - before) / (now_s - before_s)


def drop_trigger(demand_pages: Samples, available_pages: Samples, horizon_s: float = DROP_HORIZON_S) -> int:
    """Gives R, the pages a drop plan must free (0: no drop)."""
    if not demand_pages or not available_pages:
        return 0
    demand = demand_pages[-1][1] + horizon_s * latest_rate(demand_pages)
    available = available_pages[-1][1] + horizon_s * latest_rate(available_pages)
    if demand < available:
        return 0
    return max(0, math.ceil(demand - available))


def restore_trigger(
    demand_pages: Samples, capacity_undropped_pages: int, dropped_for_s: float, *,
    horizon_s: float = RESTORE_HORIZON_S, fill: float = RESTORE_FILL, min_dropped_s: float = RESTORE_MIN_DROPPED_S,
    calm_s: float = RESTORE_CALM_S,
) -> bool:
    """Gives whether to restore the dropped blocks: the drop is old enough, the demand forecast over `horizon_s`
    (never below today's demand: a falling rate does not vouch for the next burst) fits in `fill` of the KV capacity
    with every block back, and every demand sample of the last `calm_s` seconds fitted there too. The samples must
    reach back `calm_s` (a leader that has just begun to sample waits)."""
    if dropped_for_s < min_dropped_s or not demand_pages:
        return False
    limit = fill * capacity_undropped_pages
    now_s, now = demand_pages[-1]
    if max(now, now + horizon_s * latest_rate(demand_pages)) > limit:
        return False
    if demand_pages[0][0] > now_s - calm_s:
        return False
    return all(pages <= limit for time_s, pages in demand_pages if time_s > now_s - calm_s)
