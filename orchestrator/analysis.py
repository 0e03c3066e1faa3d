"""Mean response time of JFFC over chains: Theorem 3.7 bounds and exact solutions (Appendix A.3).

Assumes Poisson arrivals (rate lambda) and exponential service (rate mu_k on chain k, c_k jobs at once). Times
come out in the unit of 1 / rate: pass rates per ms to get ms. Every function raises ValueError when the system
is unstable (lambda >= nu = sum_k c_k mu_k).

The bounds are birth-death chains on the number of jobs n whose death rate is the fastest (lower bound) or the
slowest (upper bound) way JFFC's chains can be filled by n jobs; the exact solution solves the balance equations
of the occupancy vector (z_1..z_K) with arrivals blocked when every chain is full, then adds the geometric tail
of queue lengths, pi(n, full) = pi(full) rho^n.

`overflow_estimate_unclamped` is not from the paper: an O(C) estimate of JFFC's mean response (chains as Erlang
loss stages in speed order, then a queue) for instances too big to solve exactly; `overflow_mean_response` clamps
it into the bounds and is used to tune c with spare chains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# beyond this many occupancy states the exact sparse solve takes more than a few seconds (fill-in grows fast with K)
MAX_EXACT_STATES_TWO_CHAINS = 60_000
MAX_EXACT_STATES_MORE_CHAINS = 8_000


def _checked(arrival_rate: float, rates: Sequence[float], capacities: Sequence[int]) -> tuple[list[float], list[int]]:
    """Gives (rates, capacities) sorted fastest first (ties: given order), after checking stability."""
    if len(rates) != len(capacities) or not rates:
        raise ValueError("give one rate and one capacity per chain, and at least one chain")
    if not all(rate > 0 and math.isfinite(rate) for rate in rates):
        raise ValueError("chain rates must be finite and > 0")
    if not all(int(capacity) == capacity and capacity >= 1 for capacity in capacities):
        raise ValueError("chain capacities must be integers >= 1")
    if not (arrival_rate > 0 and math.isfinite(arrival_rate)):
        raise ValueError("the arrival rate must be finite and > 0")
    order = sorted(range(len(rates)), key=lambda index: (-rates[index], index))
    sorted_rates = [float(rates[index]) for index in order]
    sorted_capacities = [int(capacities[index]) for index in order]
    total = total_rate(sorted_rates, sorted_capacities)
    if arrival_rate >= total:
        raise ValueError(f"unstable: arrival rate {arrival_rate:g} >= total service rate nu = {total:g}")
    return sorted_rates, sorted_capacities


def total_rate(rates: Sequence[float], capacities: Sequence[int]) -> float:
    """Gives nu = sum_k c_k mu_k."""
    return math.fsum(rate * capacity for rate, capacity in zip(rates, capacities, strict=True))


def _birth_death_mean(arrival_rate: float, death_rates: np.ndarray, total: float) -> float:
    """Gives E[N] of a birth-death chain: birth rate lambda, death rate d(n) for n <= C and nu beyond C.

    Works in logarithms, so large C or lambda >> mu cannot overflow the products prod lambda / d(i).
    """
    jobs = len(death_rates)  # C
    log_weights = np.concatenate(([0.0], np.cumsum(np.log(arrival_rate) - np.log(death_rates))))  # log q_0..q_C
    rho = arrival_rate / total
    shift = float(log_weights.max())
    weights = np.exp(log_weights - shift)
    occupancy = np.arange(jobs + 1, dtype=float)
    # states n >= C form a geometric tail: sum_n q_n = q_C / (1 - rho), sum_n n q_n = q_C (C/(1-rho) + rho/(1-rho)^2)
    normalizer = float(weights[:jobs].sum()) + weights[jobs] / (1.0 - rho)
    mass = float((occupancy[:jobs] * weights[:jobs]).sum()) + weights[jobs] * (jobs / (1 - rho) + rho / (1 - rho) ** 2)
    return float(mass / normalizer)


def _fill_death_rates(rates: list[float], capacities: list[int], *, fastest_first: bool) -> np.ndarray:
    """Gives d(1..C): the total departure rate when n jobs fill the chains fastest first (or slowest first)."""
    per_job = np.repeat(np.asarray(rates), capacities)  # the rate of the n-th job placed, fastest first
    if not fastest_first:
        per_job = per_job[::-1]
    return np.cumsum(per_job)


def mean_response_bounds(
    arrival_rate: float, rates: Sequence[float], capacities: Sequence[int]
) -> tuple[float, float]:
    """Gives (lower, upper) bounds on JFFC's mean response time (Theorem 3.7), in the time unit of the rates."""
    sorted_rates, sorted_capacities = _checked(arrival_rate, rates, capacities)
    total = total_rate(sorted_rates, sorted_capacities)
    fast = _fill_death_rates(sorted_rates, sorted_capacities, fastest_first=True)
    slow = _fill_death_rates(sorted_rates, sorted_capacities, fastest_first=False)
    lower = _birth_death_mean(arrival_rate, fast, total) / arrival_rate
    upper = _birth_death_mean(arrival_rate, slow, total) / arrival_rate
    return lower, upper


def erlang_b(servers: int, offered_load: float) -> float:
    """Gives Erlang's loss probability B(c, a): c servers, offered load a = arrival rate / service rate."""
    loss = 1.0
    for count in range(1, servers + 1):  # B(n) = a B(n-1) / (n + a B(n-1)), stable for any c
        loss = offered_load * loss / (count + offered_load * loss)
    return loss


def overflow_estimate_unclamped(arrival_rate: float, rates: Sequence[float], capacities: Sequence[int]) -> float:
    """Gives the raw overflow estimate of JFFC's mean response time (not a bound), in the time unit of the rates.

    JFFC sends an arrival to the fastest chain with room, so the fastest chain is an Erlang loss stage fed by
    Poisson arrivals that passes on a share B(c_1, lambda / mu_1) of them to the next chain, and so on (the classic
    overflow approximation takes each overflow as Poisson; it is burstier, so later chains' losses come out a
    little low). Jobs that pass every chain wait in the central queue, drained at nu: their share is made
    Erlang-C-like, q / (1 - rho (1 - q)), and they wait 1 / (nu - lambda), then run C / nu on average. With one
    chain this is the exact M/M/c response time. Unlike Theorem 3.7's lower bound, it charges a job that lands
    on a slow chain that chain's whole service time, which matters when fast and slow chains mix.
    """
    sorted_rates, sorted_capacities = _checked(arrival_rate, rates, capacities)
    return _overflow_estimate(arrival_rate, sorted_rates, sorted_capacities)


def _overflow_estimate(arrival_rate: float, sorted_rates: list[float], sorted_capacities: list[int]) -> float:
    """Gives the raw overflow estimate for chains already checked and sorted fastest first by `_checked`."""
    total = total_rate(sorted_rates, sorted_capacities)
    flow, carried, service = arrival_rate, 0.0, 0.0
    for rate, capacity in zip(sorted_rates, sorted_capacities, strict=True):
        loss = erlang_b(capacity, flow / rate)
        carried += flow * (1.0 - loss)
        service += flow * (1.0 - loss) / rate
        flow *= loss
    passed = flow / arrival_rate  # share of arrivals that find every chain full (Poisson-overflow estimate)
    rho = arrival_rate / total
    queued = passed / (1.0 - rho * (1.0 - passed))
    jobs = sum(sorted_capacities)
    immediate = service / carried if carried > 0 else 0.0
    return (1.0 - queued) * immediate + queued * (1.0 / (total - arrival_rate) + jobs / total)


def overflow_mean_response(arrival_rate: float, rates: Sequence[float], capacities: Sequence[int]) -> float:
    """Gives `overflow_estimate_unclamped` clamped into Theorem 3.7's [lower, upper], which bracket the exact value.

    The clamp keeps tuning's pruning floor valid (no estimate below the fastest chain's service time).
    """
    sorted_rates, sorted_capacities = _checked(arrival_rate, rates, capacities)
    estimate = _overflow_estimate(arrival_rate, sorted_rates, sorted_capacities)
    lower, upper = mean_response_bounds(arrival_rate, sorted_rates, sorted_capacities)
    return min(max(estimate, lower), upper)


def exact_mean_response(
    arrival_rate: float, rates: Sequence[float], capacities: Sequence[int], *, max_states: int | None = None
) -> float:
    """Gives JFFC's exact mean response time for any number of chains, with prod (c_k + 1) <= max_states states."""
    from scipy.sparse import coo_matrix  # imported here: scipy takes a second to load and only this needs it
    from scipy.sparse.linalg import spsolve

    sorted_rates, sorted_capacities = _checked(arrival_rate, rates, capacities)
    num_states = math.prod(capacity + 1 for capacity in sorted_capacities)
    if max_states is None:
        max_states = MAX_EXACT_STATES_TWO_CHAINS if len(rates) <= 2 else MAX_EXACT_STATES_MORE_CHAINS
    if num_states > max_states:
        raise ValueError(f"{num_states} occupancy states exceed max_states={max_states}; use the bounds instead")
    capacity = np.asarray(sorted_capacities)
    rate = np.asarray(sorted_rates)
    # state index = sum_k z_k * stride_k (mixed radix, chain 1 most significant)
    strides = np.ones(len(capacity), dtype=np.int64)
    for position in range(len(capacity) - 2, -1, -1):
        strides[position] = strides[position + 1] * (capacity[position + 1] + 1)
    occupancy = np.stack(np.unravel_index(np.arange(num_states), tuple(capacity + 1)), axis=1)
    sources, targets, values = [], [], []
    has_room = occupancy < capacity
    open_states = np.flatnonzero(has_room.any(axis=1))  # the full state blocks arrivals (its queue tail is added below)
    fastest_free = np.argmax(has_room[open_states], axis=1)
    sources.append(open_states)
    targets.append(open_states + strides[fastest_free])
    values.append(np.full(len(open_states), float(arrival_rate)))
    for chain in range(len(capacity)):
        busy = np.flatnonzero(occupancy[:, chain] > 0)
        sources.append(busy)
        targets.append(busy - strides[chain])
        values.append(occupancy[busy, chain] * rate[chain])
    source, target, value = np.concatenate(sources), np.concatenate(targets), np.concatenate(values)
    outflow = np.bincount(source, weights=value, minlength=num_states)
    # balance: pi Q = 0, i.e. Q^T pi = 0 (rows: target states); the last row is replaced by sum(pi) = 1
    rows = np.concatenate((target, np.arange(num_states)))
    columns = np.concatenate((source, np.arange(num_states)))
    entries = np.concatenate((value, -outflow))
    kept = rows != num_states - 1
    rows = np.concatenate((rows[kept], np.full(num_states, num_states - 1)))
    columns = np.concatenate((columns[kept], np.arange(num_states)))
    entries = np.concatenate((entries[kept], np.ones(num_states)))
    balance = coo_matrix((entries, (rows, columns)), shape=(num_states, num_states)).tocsc()
    right = np.zeros(num_states)
    right[-1] = 1.0
    pi = np.atleast_1d(spsolve(balance, right))
    rho = arrival_rate / total_rate(sorted_rates, sorted_capacities)
    jobs = occupancy.sum(axis=1)
    full = num_states - 1  # every chain at capacity
    total_jobs = int(jobs[full])
    normalizer = math.fsum(pi) + pi[full] * rho / (1 - rho)
    mass = math.fsum(jobs * pi) + pi[full] * (total_jobs * rho / (1 - rho) + rho / (1 - rho) ** 2)
    return float(mass / normalizer / arrival_rate)


def exact_two_chain_mean_response(arrival_rate: float, rates: Sequence[float], capacities: Sequence[int]) -> float:
    """Gives JFFC's exact mean response time with two chains (Appendix A.3), in the time unit of the rates."""
    if len(rates) != 2 or len(capacities) != 2:
        raise ValueError("the exact two-chain solution needs exactly two chains")
    return exact_mean_response(arrival_rate, rates, capacities)
