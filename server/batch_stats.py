"""What a server's step scheduler has computed: batch sizes, tokens per batch, failures, decode step latencies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Latency:
    """Count, mean and maximum of some latencies in ms."""

    count: int = 0
    total_ms: float = 0.0
    max_ms: float = 0.0

    def note(self, ms: float) -> None:
        self.count += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def to_wire(self) -> dict[str, float]:
        mean_ms = self.total_ms / self.count if self.count else 0.0
        return {"count": self.count, "mean_ms": round(mean_ms, 3), "max_ms": round(self.max_ms, 3)}


@dataclass
class BatchStats:
    """What the scheduler has computed: batches by size (steps) and by tokens, and where they ran."""

    batches: int = 0
    compute_ms: float = 0.0  # summed over batches
    # the computing thread's CPU time of those batches: their compute less what the machine's other processes took
    # of its core meanwhile; all of their CPU on one torch thread, that thread's part on more (a remote-attention
    # step's is not counted: it waits on a peer)
    cpu_ms: float = 0.0
    mixed: int = 0  # batches where a prefill chunk and decode steps computed together
    prefill_tokens: int = 0  # prompt tokens computed (rows x tokens of prefill chunks)
    prefill_batches: int = 0  # batches that held a prefill chunk
    prefill_batch_ms: float = 0.0  # their compute, summed
    prefill_batch_cpu_ms: float = 0.0  # and their CPU time
    joined: int = 0  # steps that joined a batch already computing
    passed: int = 0  # decode steps that passed a prompt chunk's batch, computing on their own ahead of it
    steps_by_place: Counter[str] = field(default_factory=Counter)  # "loop" or "pool": steps computed there
    sizes: Counter[int] = field(default_factory=Counter)  # power-of-two bucket of steps per batch -> batches
    tokens: Counter[int] = field(default_factory=Counter)  # power-of-two bucket of tokens per batch -> batches
    failed: Counter[str] = field(default_factory=Counter)  # error code -> steps that failed with it
    decode_alone: Latency = field(default_factory=lambda: Latency())  # decode steps in batches without a prefill
    decode_beside_prefill: Latency = field(default_factory=lambda: Latency())  # ... in a batch with a prefill chunk
    # the latter's latency beyond the batch they finished in (less its compute): what they waited before it
    decode_beyond_batch: Latency = field(default_factory=lambda: Latency())
    decode_passing_prefill: Latency = field(default_factory=lambda: Latency())  # ... that passed a prefill chunk
    # called with (steps, tokens, compute_ms) for every batch (the server's Prometheus histograms)
    observers: list[Callable[[int, int, float], None]] = field(default_factory=list, repr=False)

    def note(self, steps: int, tokens: int, *, compute_ms: float, mixed: bool, place: str,
             prefill_tokens: int = 0, cpu_ms: float = 0.0) -> None:
        for observer in self.observers:
            observer(steps, tokens, compute_ms)
        self.batches += 1
        self.compute_ms += compute_ms
        self.cpu_ms += cpu_ms
        self.mixed += mixed
        if prefill_tokens:
            self.prefill_tokens += prefill_tokens
            self.prefill_batches += 1
            self.prefill_batch_ms += compute_ms
            self.prefill_batch_cpu_ms += cpu_ms
        self.steps_by_place[place] += steps
        self.sizes[_bucket(steps)] += 1
        self.tokens[_bucket(tokens)] += 1

    def to_wire(self) -> dict[str, object]:
        """Gives the histograms as `{"<= bound": batches}` maps, bounds in ascending order."""
        return {
            "batches": self.batches,
            "compute_ms": round(self.compute_ms, 3),
            "cpu_ms": round(self.cpu_ms, 3),
            "mixed": self.mixed,
            "prefill_tokens": self.prefill_tokens,
            "prefill_batches": self.prefill_batches,
            "prefill_batch_ms": round(self.prefill_batch_ms, 3),
            "prefill_batch_cpu_ms": round(self.prefill_batch_cpu_ms, 3),
            "joined": self.joined,
            "passed": self.passed,
            "steps_per_batch": {f"<={bound}": count for bound, count in sorted(self.sizes.items())},
            "tokens_per_batch": {f"<={bound}": count for bound, count in sorted(self.tokens.items())},
            "steps_failed": dict(self.failed),
            "decode_step_ms": {"alone": self.decode_alone.to_wire(),
                               "beside_prefill": self.decode_beside_prefill.to_wire(),
                               "beside_prefill_beyond_its_batch": self.decode_beyond_batch.to_wire(),
                               "passing_prefill": self.decode_passing_prefill.to_wire()},
        }


def _bucket(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
