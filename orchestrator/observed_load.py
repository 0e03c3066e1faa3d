"""What the orchestrator observes of its load: the arrival rate and the mean job, estimated over a sliding window.

Arrival rate: the sessions that asked for a chain in the last `window_s` seconds, divided by the window (or, while
the orchestrator has run for less than a window, by the time it has run), never below `floor_per_s`; until
`min_arrivals` sessions have been seen, the configured prior. A window rather than an exponential average: the
count of a fixed span is what the paper's lambda is, and it forgets a burst completely once it is a window old.

Job sizes: the mean prompt tokens and the mean tokens a job generated, of the jobs that ended within the window
(a job's output is known only when it ends), the prior until `min_arrivals` have ended.

Pure: the caller passes the time of each event; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from orchestrator.live_model import JobSizes


@dataclass
class ObservedLoad:
    """Sliding-window estimates of the arrival rate (jobs per second) and the mean job."""

    prior_rate_per_s: float
    prior_jobs: JobSizes
    window_s: float = 60.0
    min_arrivals: int = 5
    floor_per_s: float = 0.01
    started_s: float = 0.0
    _arrivals: deque[float] = field(default_factory=deque)
    _ended: deque[tuple[float, int, int]] = field(default_factory=deque)  # (time, prompt tokens, output tokens)
    _arrived_total: int = 0

    def __post_init__(self) -> None:
        if not (self.prior_rate_per_s > 0 and self.window_s > 0 and self.floor_per_s > 0):
            raise ValueError("the prior rate, the window and the floor must be positive")

    def arrive(self, now_s: float) -> None:
        """Counts a session that asked for a chain at `now_s`."""
        self._arrivals.append(now_s)
        self._arrived_total += 1
        self._forget(now_s)

    def end(self, now_s: float, *, prompt_tokens: int, output_tokens: int) -> None:
        """Counts a job that ended at `now_s` after `prompt_tokens` of prompt and `output_tokens` generated."""
        if prompt_tokens >= 1 and output_tokens >= 1:
            self._ended.append((now_s, prompt_tokens, output_tokens))
        self._forget(now_s)

    def _forget(self, now_s: float) -> None:
        while self._arrivals and self._arrivals[0] < now_s - self.window_s:
            self._arrivals.popleft()
        while self._ended and self._ended[0][0] < now_s - self.window_s:
            self._ended.popleft()

    def rate_per_s(self, now_s: float) -> float:
        """Gives the arrival rate estimate at `now_s`."""
        self._forget(now_s)
        if self._arrived_total < self.min_arrivals:
            return self.prior_rate_per_s
        span_s = min(self.window_s, max(now_s - self.started_s, 1e-9))
        return max(self.floor_per_s, len(self._arrivals) / span_s)

    def jobs(self, now_s: float) -> JobSizes:
        """Gives the mean job estimate at `now_s`."""
        self._forget(now_s)
        if len(self._ended) < self.min_arrivals:
            return self.prior_jobs
        count = len(self._ended)
        return JobSizes(
            prompt_tokens=sum(prompt for _, prompt, _ in self._ended) / count,
            output_tokens=sum(output for _, _, output in self._ended) / count,
        )

    @property
    def arrived_total(self) -> int:
        return self._arrived_total
