"""KunServe in the simulator (spec `kunserve.md` 5.7): replicas whose KV pages throttle under a burst, and the same
pure policies the live servers run (`drop_trigger`, `plan_drop`, `restore_trigger`) merging them into buddy groups
that hold more KV.

The model, event by event (no clock, no global RNG; the same inputs give the same result):
- A *unit* serves requests with continuous batching: a group of k replicas (k = 1 undropped) holding one copy of the
  model's blocks, so its KV capacity is k x `pages_total` - `params_pages` (the dropped copies' pages hold KV).
  An iteration computes one token of every decoding request and up to `prefill_chunk_tokens` of prefill (with
  `reserve_decode_rows`, as a swarm server forms a batch: the decode steps take their tokens of that budget first,
  and a prompt's chunk leaves a token for every other request of its unit, whose steps may join it), and
  occupies a whole replica for `step_ms + prefill_token_ms x prompt tokens + decode_token_ms x decoding requests`
  (a group's prompt tokens cost `member_prefill_token_ms` when given: what live members measured, see below; a
  batch without prompt tokens, its rows `decode_rows_ms` when given: the servers' batching curve), and with
  `work_noise` that times a factor drawn for the batch (mean 1, seeded by the replay): live batches of the same
  tokens and rows vary in their CPU time.
  A group is a pipeline of its members in slice order, in one of two ways:
  - as the paper's engine pipelines (the default): up to k micro-batches in flight, each with about 1/k of its
    requests, each crossing the k members and paying (k - 1) x `hop_ms` [chosen: no bubbles; the hops count in the
    occupancy, which keeps a pipeline's micro-batches whole];
  - with `member_batching`, as swarm servers do: each member batches on its own. When free, it computes every
    decoding step waiting at its slice and prompt chunks, at its share of the blocks' cost. A decoding step then
    crosses to the next member in `hop_ms` (the server's push); a prompt crosses once its member has computed all
    of it, in two hops (the client relays a prefill's hidden states, as the live client does). With `join_prefill`,
    decode steps that reach a member computing a prompt chunk join that batch, as a CPU server's scheduler had them:
    it waits while they catch up through the part it has done (a lone step's time over it), and they end with it.
    With `overtake_prefill`, as a CPU server's scheduler has them now, they pass it instead: they compute at once in
    a batch of their own (a chunk is passed once: later steps join it), and the chunk's batch ends that much later.
- A token reaches its client `round_trip_ms` after its iteration ends (and `round_trip_per_decoding_ms` more for each
  other request decoding then, at most `round_trip_crowd_cap` of them), and the request's next step is ready on the
  unit then: the network to the client and back takes time but occupies no server, which meanwhile computes the
  other requests' steps. A prompt's chunks follow each other without it. With `client_token_ms` and
  `client_pass_ms`, the client's own work comes first: the tokens of one iteration take one pass of its LM head,
  `client_pass_ms` for the pass and `client_token_ms` for each token in it (its row, its RPCs), and passes follow
  each other, as one client process serving every request does, whose sessions on one chain share a head pass
  (`client.batched_head`): under load, tokens queue there, and the pass's tokens go on together. With
  `client_gang_wait_s`, a pass also waits, that long at most, for the unit's decode steps still on their way, as the
  batched head keeps one chain's sessions in step.
- With `client_link_bytes_per_s`, a prompt's hidden states cross the client's link: up to its unit's first member
  at admission (and again when a drop or a restore starts its pass over), and, between members batching on their
  own, down to the client and up to the next member; prompts cross each way one after another, and the hops'
  propagation comes on top, with what a message of its size took beyond its bytes (`client_link_extra_s`, a
  flow's window: it occupies no link). A decode step's hidden state is a few kilobytes and queues behind no prompt
  [chosen].
- A request's KV is reserved at admission for its whole length (prompt + output, `blocks` x ceil(tokens /
  `tokens_per_page`) pages), as servers with `--kv-headroom-tokens` at least the output admit, on the unit with the
  fewest requests per member among those with room for it (`_place`); with `placement` "fewest_hops", as a swarm's
  clients route by latency over records that do not show load, on the unit of fewest members with room, the oldest
  first: every client takes the same whole replica until it refuses them; with "latency", on one of the units of
  fewest members with room at random (seeded `placement_seed`), as clients whose replicas sit behind equal links land
  on either by their latency probes' noise. The dispatcher keeps one FCFS queue and admits
  its head as soon as it fits (head-of-line blocking, as Llumnix's dispatcher); with `retry_backoff_s`, as a swarm's
  clients do without an orchestrator, a request that finds no room tries again after its own exponential backoff
  instead; each try takes what a live client's does before it is admitted or backs off: a DHT lookup (`lookup_s`)
  unless one that began within `records_max_age_s` has ended, then an `open` (`open_s`) on each member of its unit
  before its prompt goes up. Its pages
  return when its client's close reaches the unit: half a round trip after the client saw its last token (live
  servers free a session's pages on `close`, not at its last step).
- TTFT = admission wait + the iterations that prefill the prompt; TBT = a request's mean time per output token after
  its first (the paper's metric).
- With `cores` (servers and their client on one machine, as in a live benchmark), work runs slower while more
  processes compute than the machine has cores: each computing member and the client when busy count one, and an
  iteration or a pass of the client's work that starts with n of them runs max(1, n / cores) times its time (processor
  sharing, taken at its start) [chosen: on the first 2-core VM two 1-thread compute processes ran at full speed, three
  at 2/3 each]; with `corun_stretch`, as much longer again once every core computes, and between one process computing
  and `cores` of them, that share of it (a VM's host takes time from vCPUs that are all busy: on the Intel VM, two
  processes computing at once took 1.05-1.15x the wall time per CPU time of one alone). With `refused_try_cpu_ms`, the
  tries refused in the last second add the cores they kept busy to n: a swarm's waiting clients look up the DHT, probe
  and call `open` on every server again each round, on the same machine; with `token_cpu_ms`, so do the tokens of the
  last second (the RPC daemons and the delay fabric they cross); each of those cores counts `other_work_weight` times
  (short bursts that preempt a computing thread). The result's `compute_stretch` is how much longer the members'
  batches took than their work, as a live server's batches take over their CPU time. With `fluid_sharing`, a member's
  batch runs at the speed shared at each moment instead (taken again at every event), and ends when its work is done
  at those speeds.
- Every `monitor_s` the monitor samples demand (pages held + pages of queued requests) and KV capacity; when
  `drop_trigger` asks for R pages, `plan_drop` merges the replicas still whole into groups (while dropped too, as the
  live segment loop: a burst that outgrows the first plan pairs more replicas), and once fewer than two are whole,
  `plan_merge` merges the smallest groups (pairs into fours, each member keeping half its slice). Victims
  (requests running on a member when it drops) stall while their KV for the dropped blocks crosses
  `link_bytes_per_s` (blocking exchange, smallest first, each member's link in parallel); with `live_exchange`
  (remote attention, the paper's Sec. 4.2) they compute on meanwhile, and an iteration holding one pays a round
  trip between members (2 x `hop_ms`) per block it attends remotely. The group's extra capacity is usable at once,
  or, with `exchange_transient` (spec 5.2), a victim's KV for its member's dropped blocks counts twice until it has
  crossed. With `stopped_prompt_follow_ms`, a victim's prompt not all computed starts over on the group, as the
  swarm's servers stop it: after its batch ends and its client followed the new chain. While dropped,
  `restore_trigger` splits every group back once their requests fit on the members (live restore: no stall).
- `static_groups` k > 1 runs the static pipeline baseline (Llumnix (pipeline)): groups of k from the start, never
  restored; `dropping` False the no-drop baseline (Llumnix (replication)).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.admission import (
    NAMED_ROOM_GRACE_S,
    NAMED_ROOM_LEAD_S,
    KVPolicy,
    NamedWait,
    SessionPace,
    averaged_interval,
    busy_retry_wait,
    pages_kept_for_named,
    room_in_s,
)
from orchestrator.buddy import (
    RESTORE_CALM_S,
    SegmentReplica,
    drop_trigger,
    plan_drop,
    plan_merge,
    restore_trigger,
    stale_count,
)


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s), prompt and output tokens."""

    arrival_s: float
    prompt: int
    output: int


PLACEMENTS = ("least_loaded", "fewest_hops", "latency")
MICRO_BATCH = -1  # a `_Batch`'s member when a group's micro-batch crosses all of its members
REFUSED_LOAD_WINDOW_S = 1.0  # a refused try's CPU counts against the cores over this long
TOKEN_LOAD_WINDOW_S = 1.0  # and a token's (`token_cpu_ms`)
RESCHEDULE_TOLERANCE_S = 1e-9  # a batch's end that moved less than this (rounding) keeps its event


@dataclass(frozen=True)
class KunServeSimConfig:
    """The replicas, their memory and speed, the network between them, and the policies' knobs."""

    replicas: int
    blocks: int
    pages_total: int  # per replica
    params_pages: int  # per replica, all blocks (a multiple of `blocks`)
    tokens_per_page: int  # KV tokens one page holds for one block
    step_ms: float  # an iteration's fixed cost on a whole replica
    prefill_token_ms: float  # and per prompt token it computes
    decode_token_ms: float  # and per decoding request (beside a prompt's tokens, or without `decode_rows_ms`)
    hop_ms: float = 0.0  # one activation hop between group members
    round_trip_ms: float = 0.0  # a token's way to its client and the next step's back, outside the unit
    # and this much more for each other request decoding when it passes, at most `round_trip_crowd_cap` of them: the
    # machine's shared cores outside the modelled work (the RPC layers, the p2pd daemons) [chosen: live, a token took
    # 86-96 ms with one request decoding and 169-197 ms with three or four (r51, r53-r55); one constant fitted on the
    # whole run overpriced the quiet requests and underpriced the crowd's. Uncapped, the pipelined arms' 8-12 requests
    # decoding at once priced their TBT P90 at 452-496 ms against 323-445 live]
    round_trip_per_decoding_ms: float = 0.0
    round_trip_crowd_cap: int = 3
    client_token_ms: float = 0.0  # the client's own work for each token (its head row, its RPCs)
    client_pass_ms: float = 0.0  # and for each pass of its LM head over the tokens of one iteration
    link_bytes_per_s: float = 12.5e6  # a member's link for the KV exchange
    kv_bytes_per_token_block: int = 1536
    prefill_chunk_tokens: int = 512
    monitor_s: float = 0.5
    dropping: bool = True
    static_groups: int = 1
    balanced: bool = True
    restore_after_s: float = 10.0
    restore_calm_s: float = RESTORE_CALM_S
    # Without a dispatcher (a swarm's clients): a request that finds no room tries again after its own backoff,
    # (first, longest) seconds doubling, and counts in the demand for `refused_window_s` after each refusal (the
    # servers' `kv_demand_pages`, which count it until its longest backoff has passed); None: one FCFS queue that
    # admits its head as soon as it fits.
    retry_backoff_s: tuple[float, float] | None = None
    # With `retry_backoff_s`: a refusal names when the unit expects room, as the swarm's servers' do
    # (`SessionTable.room_in_s`): the waits refused before it in, as its requests end at their intervals between
    # tokens (a request with none yet at the unit's median); a request asks again then if that is sooner than its
    # backoff (`orchestrator.admission.busy_retry_wait`)
    retry_hint: bool = False
    # With `retry_hint`: a unit keeps the room it named from the tries of later waits about that time, as the swarm's
    # servers do (`SessionTable.kept_for_named`), from `keep_window_s` before the time to after it
    keep_named: bool = False
    keep_window_s: tuple[float, float] = (NAMED_ROOM_LEAD_S, NAMED_ROOM_GRACE_S)
    # With `retry_backoff_s`: a client admitted on one unit withdraws its wait from the others, which forget it (it
    # no longer stands in their line, nor keeps room there), as the swarm's clients do (`SwarmClient.withdraw_wait`):
    # once its `open` calls are done and one more call has reached them
    withdraw_waits: bool = False
    refused_window_s: float = 5.0
    # A client's try (with `retry_backoff_s`), as a live client's: a DHT lookup (`lookup_s`) unless a try began one
    # at most `records_max_age_s` before and it has ended (the client routes on those records: live, half the rounds
    # or more found none that fresh; 0: every try looks up), then an `open` call (`open_s`) on each member of the unit
    # it lands on, one after another, before its prompt goes up; it is admitted, or refused on the servers' state at
    # its lookup's end, and a refused try calls `open` on every unit (each refuses at its first member) before it
    # backs off [the reports up to r38's gave every try one figure, the median round of lookup and opens].
    lookup_s: float = 0.0
    records_max_age_s: float = 0.0
    open_s: float = 0.0
    # Live exchange (remote attention, spec 3.5): a victim goes on computing while its KV follows; until it has
    # arrived, an iteration holding it pays one round trip between members per block it attends remotely
    live_exchange: bool = False
    # A victim whose prompt a drop caught (not all of it computed yet), None: it keeps what its unit computed of it
    # and goes on through the group at once. A number: as the swarm's servers do it (`StepScheduler.stop_step`), the
    # prompt stops where its batch ends, what it computed is lost (the session stays at the step's start), and its
    # client sends it all again through the group this many ms later: the session's part moving, the servers'
    # `ChainChanged` reaching the client, and the client following it (r56-r59: a drop caught a prompt in 5 of 8
    # KunServe runs; r57's was the arm's P99 request, 3.56 s live against 1.84 s with this None)
    stopped_prompt_follow_ms: float | None = None
    # Where arrivals go: "least_loaded" (a dispatcher that sees every unit's load), "fewest_hops" (swarm clients
    # routing by latency over records that do not show load: the unit of fewest members with room, the oldest first)
    # or "latency" (the same, one of those units at random: replicas behind equal links, as the burst benchmark's,
    # which its live clients chose by their latency probes' noise: of the arrivals that found one replica busier than
    # the other, half went to each in r50-r58)
    placement: str = "least_loaded"
    placement_seed: int = 0  # with "latency": which of the units with room each request lands on
    # The cores that the servers and their client share (a live benchmark on one machine), None: a processor each
    cores: int | None = None
    # With `cores` and `retry_backoff_s`: the CPU a refused try costs that machine (the client's DHT lookups, its RTT
    # probes and `open` calls, and the DHT's and servers' side of them), counted against the cores for
    # `REFUSED_LOAD_WINDOW_S` after the try
    refused_try_cpu_ms: float = 0.0
    # With `cores`: the CPU each token costs that machine outside the members' batches and the client's passes (the
    # RPC daemons and the delay fabric it crosses), counted against the cores for `TOKEN_LOAD_WINDOW_S` after the
    # client has it, the same through a group's members as through a whole replica [chosen: a token through the static
    # pipeline's pair cost 8.0-8.1 ms against 7.1-7.5 through one whole server in r31, 8.4 against 4.2-5.1 in r32;
    # the runs do not settle a weight, and one per RPC leg (a pair 1.5x) fitted r31 no better]
    token_cpu_ms: float = 0.0
    # With `cores`: how many times its time work takes while every core computes, beyond the cores' sharing (the
    # host's steal from a VM whose vCPUs are all busy, caches and memory the cores share), between one process
    # computing and `cores` of them that share of it [chosen: measured on the machine (`benchmarks/corun.py`), not
    # fitted: the no-drop arm's fitted weight of the other work carried none of it into the arms that pipeline, whose
    # two members compute at once through a burst, and priced them 16-29% low on the Intel VM (r81-r84)]
    corun_stretch: float = 1.0
    # With `cores`: a member's batch runs at the speed the processes computing at each moment share (taken again at
    # every event, as a fluid processor-sharing queue); False: at the speed shared when it started, for its whole time.
    # The client's passes keep the speed shared when they start either way
    fluid_sharing: bool = False
    # How a group pipelines: False, as the paper's engine, up to k micro-batches in flight, each with about 1/k of
    # its requests and holding them for its whole traversal; True, as swarm servers, each member batching the steps
    # that reached it on its own
    member_batching: bool = False
    # With the client's work: how long a pass of its head waits for the decode steps of the same unit still on their
    # way (`client.batched_head`: sessions on one chain go on in step), 0: it never waits
    client_gang_wait_s: float = 0.0
    # With `member_batching`: decode steps that reach a member computing a prompt chunk join its batch there, as a
    # CPU server's scheduler has them (`StepScheduler._worth_joining`): the batch waits while they catch up through
    # the blocks it has passed, at a lone step's time, and they end with it
    join_prefill: bool = False
    # With `member_batching`: decode steps that reach a member computing a prompt chunk pass it, as a CPU server's
    # scheduler has them (`StepScheduler._passes`): they compute at once in a batch of their own, and the chunk's
    # batch waits for them (the server's one compute thread); unless the rest
    # of the chunk would hold them less than `overtake_gain` x their own batch, or steps passed it already: then they
    # join it (`join_prefill`)
    overtake_prefill: bool = False
    overtake_gain: float = 2.0  # the servers' `PASS_GAIN`
    # The client's link, each way (bytes/s; 0: no limit): a prompt pass's hidden states (`hidden_bytes_per_token` a
    # token) go up it to the unit's first member, and with `member_batching` down from each member to the client and
    # up to the next, one after another on each way, as the live client relays a prefill [chosen: a decode step's
    # few kilobytes queue behind no prompt, as the links' flows share them]
    client_link_bytes_per_s: float = 0.0
    hidden_bytes_per_token: int = 0
    # What a prompt pass's message takes beyond its bytes at `client_link_bytes_per_s`, by its size: (bytes, s)
    # points, rising sizes, between them linear, from (0, 0) up and at the largest one's beyond it. It delays the
    # message's arrival and occupies no link [chosen: as measured (`benchmarks/link_crossing.py`): from ~128 tokens
    # on, a message sent or received as the first on a new stream, as each session's prompt crosses, took 0.4-1.5
    # round trips more than its bytes, a wait on the stream's window while other flows go on]
    client_link_extra_s: tuple[tuple[int, float], ...] = ()
    # A prompt token's cost through all blocks in a group of more than one member, None: `prefill_token_ms`. Live,
    # members of a pipeline computed a prompt token 0.72-1.55x as long per block as the no-drop arm's whole replicas
    # did (r20-r22), which the whole replicas' costs do not show [chosen: measured per arm, not modelled]
    member_prefill_token_ms: float | None = None
    # What the decoding requests of a batch without prompt tokens cost through all blocks beyond `step_ms`, by how many
    # there are: (rows, ms) points, rising rows, between them linear, from (0, 0) up and along the last two's slope
    # beyond the last; empty: `decode_token_ms` each [chosen: a server's batches grow cheaper per row as they widen (a
    # CPU server timed 0.14 ms a row and block from 1 to 8 rows, 0.03 from 8 to 32); one slope from 1 to 32 priced the
    # 5-row decode batches of a pipeline's members 30% below their CPU time (r84), where a whole replica's 1-2 rows
    # were priced right. Beside a prompt's tokens the batch is wide already, and a row costs `decode_token_ms`]
    decode_rows_ms: tuple[tuple[int, float], ...] = ()
    # The exchange's transient (spec 5.2, which the paper does not discuss): a victim's KV for the blocks its member
    # dropped takes pages on the keeper before the sender frees its own, so a drop's pages come free for new requests
    # only as the victims' KV crosses, as live servers hold them back (`SessionTable.hold_for_exchange`); False: at once
    exchange_transient: bool = False
    # With `cores`: how many cores the machine's other work (`refused_try_cpu_ms`, `token_cpu_ms`) takes from the
    # processes that compute, per core of CPU it spends [chosen: fitted so that the simulated no-drop servers' batches
    # take as much longer than their work as the live ones' took over their CPU time (`kunserve_burst.sim_config`):
    # that work runs in short bursts (an RPC, a packet at real-time priority) that preempt a computing thread and
    # take its caches with it, more than its CPU share]
    other_work_weight: float = 1.0
    # How a batch shares its `prefill_chunk_tokens`: False, a prompt's chunk takes them all beside the decode steps;
    # True, as the swarm's servers (`StepScheduler._next_batch`), decode steps take a token each first and a prompt's
    # chunk leaves one for every other request of its unit, whose decode steps may join it [chosen: what the live
    # servers do; a pipeline's members hold every session of the pair (up to 11 each in r36, the whole no-drop
    # servers 2), so their prompts take more batches: without it the simulated pipelined arms' P99 TTFT was 26-34%
    # below live on r36's first turn, with it 15-24%]
    reserve_decode_rows: bool = False
    # How much a batch's compute varies beyond what its tokens and rows say (a page fault, the allocator, caches that
    # another process took): each member's batch, a pass and a micro-batch take their work times a factor drawn
    # from a lognormal of mean 1 with this sd of its log, seeded by `placement_seed`; 0: none [chosen: measured (the
    # benchmark's `batch_noise`: the log of the no-drop servers' batches' CPU time over a fit in their prompt tokens
    # and decode rows, 0.16-0.28 on the Intel VM in r89). Without it every simulated prompt of a burst waited about
    # as long as the others, and the live P99, the unluckiest prompt of the burst, came 10-15% above the simulated
    # one in the arms that pipeline on average over r79-r89, while their mean TTFT over the burst matched (r89)]
    work_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.params_pages % self.blocks or self.params_pages >= self.pages_total:
            raise ValueError("params_pages must be a multiple of blocks and below pages_total")
        if self.static_groups < 1 or self.replicas % self.static_groups:
            raise ValueError("static_groups must divide the replicas")
        if min(self.lookup_s, self.records_max_age_s, self.open_s, self.refused_try_cpu_ms, self.token_cpu_ms,
               self.client_gang_wait_s, self.client_link_bytes_per_s, self.hidden_bytes_per_token) < 0:
            raise ValueError("lookup_s, records_max_age_s, open_s, refused_try_cpu_ms, token_cpu_ms, "
                             "client_gang_wait_s, client_link_bytes_per_s and hidden_bytes_per_token must be >= 0")
        sizes = [size for size, _ in self.client_link_extra_s]
        if sizes != sorted(set(sizes)) or any(size <= 0 or extra < 0 for size, extra in self.client_link_extra_s):
            raise ValueError("client_link_extra_s must hold rising sizes > 0 with extras >= 0")
        rows = [count for count, _ in self.decode_rows_ms]
        costs = [0.0, *(ms for _, ms in self.decode_rows_ms)]
        if rows != sorted(set(rows)) or any(count <= 0 for count in rows) or costs != sorted(costs):
            raise ValueError("decode_rows_ms must hold rising rows > 0 with costs >= 0 that do not fall")
        if self.member_prefill_token_ms is not None and self.member_prefill_token_ms < 0:
            raise ValueError("member_prefill_token_ms must be >= 0 (or None)")
        if self.cores is not None and self.cores < 1:
            raise ValueError("cores must be >= 1 (or None)")
        if self.other_work_weight < 0:
            raise ValueError("other_work_weight must be >= 0")
        if self.corun_stretch <= 0:
            raise ValueError("corun_stretch must be > 0")
        if self.work_noise < 0:
            raise ValueError("work_noise must be >= 0")
        if self.round_trip_per_decoding_ms < 0 or self.round_trip_crowd_cap < 0:
            raise ValueError("round_trip_per_decoding_ms and round_trip_crowd_cap must be >= 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.keep_named and not self.retry_hint:
            raise ValueError("keep_named keeps the room retry_hint names: it needs retry_hint")

    @property
    def params_pages_per_block(self) -> int:
        return self.params_pages // self.blocks

    def pages_of(self, request: SimRequest) -> int:
        return self.blocks * math.ceil((request.prompt + request.output) / self.tokens_per_page)


@dataclass(eq=False)
class _Running:
    index: int
    request: SimRequest
    pages: int
    prefilled: int = 0
    produced: int = 0
    first_token_s: float | None = None
    ready_s: float = 0.0  # its next step can compute from then: a victim's KV has arrived, its token's round trip
    remote_until_s: float = 0.0  # live exchange: until then it attends over `remote_blocks` blocks remotely
    remote_blocks: int = 0
    in_flight: bool = False  # in a batch computing now
    at_client: bool = False  # its token waits at the client for a head pass (`client_gang_wait_s`)
    closing: bool = False  # its last token is on its way to the client, whose close frees its pages
    interval_s: float | None = None  # its time between tokens at the client (a running average), once it has one
    last_seen_s: float = 0.0  # when the client saw its latest token
    stage: int = 0  # the member (index in its unit's members) its step waits at or computes on
    pass_done: int = 0  # prompt tokens of its current pass computed at `stage` (before the last member's)
    stopped: bool = False  # a drop caught its prompt in a batch: that batch's end restarts it (`stopped_prompt_...`)


@dataclass(eq=False)
class _Unit:
    uid: int
    members: tuple[int, ...]
    capacity: int
    running: list[_Running] = field(default_factory=list)
    # With `exchange_transient`: (until s, pages) that a drop's exchange holds twice: a victim's KV for the blocks its
    # member dropped, on the keeper and not yet freed on the sender, until it has crossed
    copies: list[tuple[float, int]] = field(default_factory=list)
    batches: int = 0  # micro-batches in flight (a group without `member_batching`: up to k)
    wake_s: float | None = None  # a wake-up is due then: its first step not ready yet

    @property
    def held(self) -> int:
        return sum(r.pages for r in self.running) + sum(pages for _, pages in self.copies)

    @property
    def free(self) -> int:
        return self.capacity - self.held


@dataclass(eq=False)
class _Batch:
    """What one member (or a micro-batch, `MICRO_BATCH`) of unit `uid` computes at once: (request, tokens) items,
    from `started_s` to `end_s` (later if steps join it, `join_prefill`)."""

    uid: int
    member: int
    last: bool  # the unit's last member: its tokens are done through every block
    items: list[tuple[_Running, int]]
    started_s: float = 0.0
    end_s: float = 0.0
    prefill: bool = False  # it computes a prompt chunk
    passing: bool = False  # decode steps passing the prompt chunk's batch that `computing` holds for its member
    passed: bool = False  # a prompt chunk's batch that decode steps passed (a chunk is passed once)
    # With `fluid_sharing`: its compute at full speed (ms, joined steps' included), what is left of it, and the hops'
    # delay still to come after it
    work_ms: float = 0.0
    left_ms: float = 0.0
    tail_ms: float = 0.0
    hops_ms: float = 0.0  # the hops' delay it started with (`tail_ms` before any of it passed)
    done: bool = False


@dataclass(frozen=True)
class KunServeSimResult:
    """Per request: TTFT and TBT (s; NaN if it never started or produced one token); victims' stalls; the drops and
    restores; (time, demand, capacity) samples."""

    ttft_s: np.ndarray
    tbt_s: np.ndarray
    stalls_s: tuple[float, ...]
    drops: int
    restores: int
    largest_group: int
    samples: tuple[tuple[float, int, int], ...]
    end_s: float
    # the members' batches' time (less their hops) over their compute at full speed: how much sharing the cores
    # slowed them (NaN if none computed)
    compute_stretch: float = math.nan

    def percentile(self, values: np.ndarray, q: float) -> float:
        finite = values[np.isfinite(values)]
        return float(np.percentile(finite, q)) if finite.size else math.nan


def simulate(config: KunServeSimConfig, requests: Sequence[SimRequest], *, horizon_s: float = 3600.0
             ) -> KunServeSimResult:
    """Runs `requests` (arrival order) through the replicas; gives every request's TTFT and TBT."""
    return _Sim(config, requests, horizon_s).run()


class _Sim:
    def __init__(self, config: KunServeSimConfig, requests: Sequence[SimRequest], horizon_s: float) -> None:
        self.config, self.requests, self.horizon_s = config, list(requests), horizon_s
        self.placing = random.Random(config.placement_seed)
        self.noise = random.Random(f"work noise {config.placement_seed}")  # `work_noise`: apart from the placing
        self.next_uid = 0
        k = config.static_groups
        self.units: dict[int, _Unit] = {}
        for start in range(0, config.replicas, k):
            self._add_unit(tuple(range(start, start + k)))
        self.queue: deque[int] = deque()
        self.backing_off: dict[int, tuple[float, float]] = {}  # request -> (its next backoff s, last refusal s)
        # per member: the requests its unit refused (a unit refuses at its first member, as a pair's first server
        # does), request -> (its latest refusal s, its first, when its latest refusal named room to come or None),
        # until it opens on that unit or `refused_window_s` has passed since its latest refusal, as a live server
        # remembers its refused waits (`SessionTable.refused`)
        self.refused: dict[int, dict[int, tuple[float, float, float | None]]] = {}
        self.events: list[tuple[float, int, str, int, _Batch | None]] = []
        self.sequence = 0
        self.ttft = np.full(len(self.requests), math.nan)
        self.tbt = np.full(len(self.requests), math.nan)
        self.stalls: list[float] = []
        self.demand: list[tuple[float, int]] = []
        self.available: list[tuple[float, int]] = []
        self.samples: list[tuple[float, int, int]] = []
        self.dropped_at: float | None = None
        self.drops = self.restores = 0
        self.largest_group = k
        self.link_free_s: dict[int, float] = {}  # per member: when its link has sent the victims' KV queued on it
        self.now = 0.0
        self.done = 0
        self.client_free_s = 0.0  # when the client has done the tokens it received so far
        self.client_link_free_s = {"up": 0.0, "down": 0.0}  # when each way of its link has sent what queued on it
        # per unit: tokens at the client waiting for the rest of its decode steps, and until when they wait
        self.gangs: dict[int, tuple[float, list[_Running]]] = {}
        self.kept = {member: _even_slice(config.blocks, k, member % k) for member in range(config.replicas)}
        self.computing: dict[int, _Batch] = {}  # members computing a batch now, and the batch
        self.refused_tries: deque[float] = deque()  # when the tries of the last `REFUSED_LOAD_WINDOW_S` were refused
        self.tokens_seen: deque[float] = deque()  # when the tokens of the last `TOKEN_LOAD_WINDOW_S` came out
        # With `fluid_sharing`: how many times its own time the members' batches have taken since `advanced_s`
        self.fluid = config.cores is not None and config.fluid_sharing
        self.stretch, self.advanced_s = 1.0, 0.0
        self.batch_wall_ms = self.batch_work_ms = 0.0  # the members' batches' time less hops, and their work
        self.lookups: deque[float] = deque()  # when clients' tries began the DHT lookups of the last moments

    def _add_unit(self, members: tuple[int, ...]) -> _Unit:
        c = self.config
        unit = _Unit(self.next_uid, members, len(members) * c.pages_total - c.params_pages)
        self.units[unit.uid] = unit
        self.next_uid += 1
        return unit

    def _push(self, when: float, kind: str, subject: int, batch: _Batch | None = None) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, subject, batch))

    def run(self) -> KunServeSimResult:
        for index, request in enumerate(self.requests):
            self._push(request.arrival_s, "arrive", index)
        self._push(0.0, "monitor", 0)
        while self.events and self.done < len(self.requests):
            self.now, _, kind, subject, batch = heapq.heappop(self.events)
            if self.now > self.horizon_s:
                break
            self._advance()
            if kind == "arrive" and self.config.retry_backoff_s is not None:
                route_s = self._route_s()
                if route_s > 0:
                    self._push(self.now + route_s, "try", subject)
                else:
                    self._try(subject)
            elif kind == "retry":  # after a backoff the live client looks up afresh, whatever records it has
                self.lookups.append(self.now)
                self._push(self.now + self.config.lookup_s, "try", subject)
            elif kind == "try":
                self._try(subject)
            elif kind == "arrive":
                self.queue.append(subject)
                self._dispatch()
            elif kind == "step":
                assert batch is not None
                if batch.done:
                    pass  # an end it no longer has (with `cores`: it was rescheduled, sooner)
                elif batch.end_s > self.now:  # it ends later: steps joined it, or (fluid) more work shares the cores
                    if not self.fluid:
                        self._push(batch.end_s, "step", subject, batch)
                else:
                    self._finish_step(batch)
            elif kind == "close":
                self._close(subject)
            elif kind == "gang":
                deadline_s, gang = self.gangs.get(subject, (math.inf, []))
                if deadline_s <= self.now:  # not a gang that passed before its wait was up
                    del self.gangs[subject]
                    self._client_pass(gang)
                    self._start_all()
            elif kind == "wake":
                unit = self.units.get(subject)
                if unit is not None:
                    if unit.wake_s is not None and unit.wake_s <= self.now:
                        unit.wake_s = None
                    self._start(unit)
            elif kind == "withdraw":
                for waits in self.refused.values():
                    waits.pop(subject, None)
            elif kind == "copied":
                self._copied(subject)
            elif kind == "monitor":
                self._monitor()
                self._push(self.now + self.config.monitor_s, "monitor", 0)
            self._reschedule()
        stretch = self.batch_wall_ms / self.batch_work_ms if self.batch_work_ms > 0 else math.nan
        return KunServeSimResult(self.ttft, self.tbt, tuple(self.stalls), self.drops, self.restores,
                                 self.largest_group, tuple(self.samples), self.now, stretch)

    # ---- serving

    def _route_s(self) -> float:
        """Gives how long a try that begins now takes before it opens: a DHT lookup (`lookup_s`) unless one that
        began within `records_max_age_s` has ended (during one, a try looks up on its own, as the live client does)."""
        c = self.config
        while self.lookups and self.lookups[0] < self.now - max(c.records_max_age_s, c.lookup_s):
            self.lookups.popleft()
        if any(began + c.lookup_s <= self.now <= began + c.records_max_age_s for began in self.lookups):
            return 0.0
        self.lookups.append(self.now)
        return c.lookup_s

    def _try(self, index: int) -> None:
        """A client's attempt to open request `index`: admitted where it fits (its prompt goes up once its `open`
        calls are done), else it backs off (once every unit refused its `open`)."""
        c = self.config
        assert c.retry_backoff_s is not None
        pages = c.pages_of(self.requests[index])
        unit = self._place(pages, index)
        if unit is not None:
            self.backing_off.pop(index, None)
            self.refused.get(unit.members[0], {}).pop(index, None)
            unit.running.append(self._admitted(index, pages, self.now + c.open_s * len(unit.members)))
            self._start(unit)
            if c.withdraw_waits:
                self._push(self.now + c.open_s * (len(unit.members) + 1), "withdraw", index)
            return
        if c.refused_try_cpu_ms > 0 and c.cores is not None:
            self.refused_tries.append(self.now)
        first, longest = c.retry_backoff_s
        backoff = self.backing_off.get(index, (first, 0.0))[0]
        soon_s = None
        if c.retry_hint:
            for unit in self.units.values():
                waits = self.refused.setdefault(unit.members[0], {})
                waits[index] = (self.now, waits.get(index, (0.0, self.now, None))[1], None)
            soon_s = self._room_in_s(index, pages)
        wait_s, next_backoff = busy_retry_wait(backoff, soon_s)
        self.backing_off[index] = (min(longest, next_backoff), self.now)
        self._push(self.now + c.open_s * len(self.units) + wait_s, "retry", index)

    def _room_in_s(self, index: int, pages: int) -> float | None:
        """Gives the soonest a unit expects room for refused request `index` of `pages`, as a swarm server names it
        (`retry_hint`): after the requests it refused before this one and still remembers (those that opened on
        another unit meanwhile too: a server does not know), None if none does. Each unit keeps its time for the
        request's wait (`_kept`)."""
        c = self.config
        policy = KVPolicy(c.tokens_per_page)
        soonest = None
        for unit in self.units.values():
            waits = self._waits(unit)
            last, since, _ = waits[index]
            ahead = sum(c.pages_of(self.requests[other]) for other, (_, first, _) in waits.items()
                        if other != index and first < since)
            running = [SessionPace(r.request.output - r.produced, r.interval_s, r.pages) for r in unit.running]
            room_s = room_in_s(policy, pages_free=unit.free, reserve=0, new_session_pages=pages, running=running,
                               ahead_pages=ahead)
            waits[index] = (last, since, None if room_s is None else self.now + room_s)
            if room_s is not None and (soonest is None or room_s < soonest):
                soonest = room_s
        return soonest

    def _waits(self, unit: _Unit) -> dict[int, tuple[float, float, float | None]]:
        """Gives the waits `unit` refused and still remembers (`refused`), forgetting those past `refused_window_s`."""
        waits = self.refused.setdefault(unit.members[0], {})
        for other in [other for other, (last, _, _) in waits.items() if self.now - last > self.config.refused_window_s]:
            del waits[other]
        return waits

    def _kept(self, unit: _Unit, index: int) -> int:
        """Gives the free pages of `unit` that request `index` may not take now (`keep_named`): the room it named to
        the waits it refused before, about their time, as a swarm server keeps it (`SessionTable.kept_for_named`)."""
        waits = self._waits(unit)
        since = waits[index][1] if index in waits else self.now
        named = [NamedWait(first, room_at, self.config.pages_of(self.requests[other]))
                 for other, (_, first, room_at) in waits.items() if other != index and room_at is not None]
        return pages_kept_for_named(named, now_s=self.now, since_s=since, window_s=self.config.keep_window_s)

    def _dispatch(self) -> None:
        c = self.config
        largest = max(len(u.members) for u in self.units.values()) * c.pages_total - c.params_pages
        while self.queue:
            index = self.queue[0]
            pages = c.pages_of(self.requests[index])
            if pages > largest:  # fits on no unit, ever: never served (NaN)
                self.queue.popleft()
                self.done += 1
                continue
            unit = self._place(pages)
            if unit is None:
                return
            self.queue.popleft()
            unit.running.append(self._admitted(index, pages))
            self._start(unit)

    def _admitted(self, index: int, pages: int, opened_s: float | None = None) -> _Running:
        """Gives request `index` admitted now with `pages`: its prompt is on its way up the client's link (from
        `opened_s`, when its client has opened its session on every member)."""
        running = _Running(index, self.requests[index], pages)
        self._restart_pass(running, opened_s)
        return running

    def _restart_pass(self, running: _Running, from_s: float | None = None) -> None:
        """Has `running`'s pass start (again) at its unit's first member: a prompt's hidden states go up the
        client's link first (from `from_s` if later than now)."""
        running.stage, running.pass_done = 0, 0
        if running.prefilled < running.request.prompt:
            at_s = self.now if from_s is None else max(self.now, from_s)
            running.ready_s = max(running.ready_s, self._cross("up", running, at_s))

    def _moved(self, running: _Running) -> None:
        """`running` moved to a new unit (a drop, a restore): its pass starts again there, now if it is not computing,
        else when its batch ends on the old one (`_finish_step`, which sees the unit replaced)."""
        if not running.in_flight:
            self._restart_pass(running)

    def _stop_prompt(self, running: _Running) -> None:
        """A drop caught `running`'s prompt (`stopped_prompt_follow_ms`): it is sent again from its first token, a
        follow after now, or after its batch ends on the old unit if it is computing (`_finish_step`)."""
        running.prefilled = running.pass_done = 0
        if running.in_flight:
            running.stopped = True
            return
        self._restart_pass(running, self.now + (self.config.stopped_prompt_follow_ms or 0.0) / 1000)

    def _cross(self, way: str, running: _Running, at_s: float) -> float:
        """Gives when the hidden states of `running`'s prompt pass, queued at `at_s` on `way` ("up" or "down") of
        the client's link, have crossed it (and its `client_link_extra_s` has passed); `at_s` without a limit."""
        c = self.config
        if c.client_link_bytes_per_s <= 0:
            return at_s
        size = (running.request.prompt - running.prefilled) * c.hidden_bytes_per_token
        self.client_link_free_s[way] = max(at_s, self.client_link_free_s[way]) + size / c.client_link_bytes_per_s
        return self.client_link_free_s[way] + link_extra_s(c.client_link_extra_s, size)

    def _place(self, pages: int, index: int | None = None) -> _Unit | None:
        """Gives the unit a request of `pages` goes to: among those with room for it, the one running the fewest
        requests per member (ties: the most free pages); None if none has room. [chosen: KunServe's dispatcher
        re-balances load after a drop so that a group's freed memory does not queue the burst on its members'
        compute (Sec. 4.3); placing by free pages alone sent every arrival to the newest group, whose prefill then
        queued for seconds while the whole replicas computed less.] With `placement` "fewest_hops": the unit of
        fewest members with room, the oldest first, whatever its load (swarm clients' latency routing); "latency": one
        of those at random, whatever its load. A client's try
        (`index`) does not take the room a unit named to the waits before it (`_kept`, with `keep_named`)."""
        kept = ({uid: self._kept(unit, index) for uid, unit in self.units.items()}
                if index is not None and self.config.keep_named else {})
        fits = [unit for unit in self.units.values() if unit.free - kept.get(unit.uid, 0) >= pages]
        if self.config.placement == "fewest_hops":
            return min(fits, key=lambda u: (len(u.members), u.uid), default=None)
        if self.config.placement == "latency":
            fewest = min((len(unit.members) for unit in fits), default=0)
            nearest = sorted((unit for unit in fits if len(unit.members) == fewest), key=lambda unit: unit.uid)
            return self.placing.choice(nearest) if nearest else None
        return min(fits, key=lambda u: (len(u.running) / len(u.members), -u.free, u.uid), default=None)

    def _start(self, unit: _Unit) -> None:
        """Starts a batch on each member of `unit` that is free and has steps ready at its slice: every decoding
        step, and prompt chunks within `prefill_chunk_tokens`. A group without `member_batching` starts
        micro-batches instead (`_start_micro_batches`)."""
        c = self.config
        if len(unit.members) > 1 and not c.member_batching:
            self._start_micro_batches(unit)
            return
        last = len(unit.members) - 1
        waiting: list[float] = []
        for stage, member in enumerate(unit.members):
            computing = self.computing.get(member)
            takes_decodes = c.join_prefill or c.overtake_prefill
            if computing is not None and not (takes_decodes and computing.prefill and computing.uid == unit.uid):
                continue  # busy (a batch of the unit it was in before a drop or restore takes no one)
            ready = []
            for running in unit.running:
                if running.stage == stage and not (running.in_flight or running.closing or running.at_client):
                    if running.ready_s <= self.now:
                        ready.append(running)
                    else:
                        waiting.append(running.ready_s)
            share = self._share(member, len(unit.members))
            if computing is not None:
                decoding = [r for r in ready if r.prefilled >= r.request.prompt]
                if c.overtake_prefill:
                    self._overtake(computing, decoding, share, len(unit.members), stage == last)
                else:
                    self._join(computing, decoding, share)
                continue
            items = self._batch(ready, unit)
            if not items:
                continue
            work_ms, remote = self._work(items, len(unit.members))
            work_ms = self._noisy(work_ms)
            batch = _Batch(unit.uid, member, stage == last, items, self.now,
                           prefill=any(r.prefilled < r.request.prompt for r, _ in items))
            self.computing[member] = batch  # it counts among the processes computing
            batch.work_ms = batch.left_ms = work_ms * share
            batch.tail_ms = batch.hops_ms = 2 * remote * share * c.hop_ms
            compute_ms = work_ms * share * self._sharing(client=self.client_free_s > self.now)
            batch.end_s = self.now + (compute_ms + batch.tail_ms) / 1000
            self._push(batch.end_s, "step", member, batch)
        self._wake(unit, waiting)

    def _join(self, batch: _Batch, decoding: list[_Running], share: float) -> None:
        """Decode steps `decoding` join `batch`, a prompt chunk's batch computing on a member with `share` of the
        blocks: it waits while they catch up through the part it has done (a lone step's time over it), and each
        adds its row's cost over the rest; they end with it."""
        if not decoding:
            return
        c = self.config
        if self.fluid:  # its progress so far, at the speeds it had
            done = 1 - batch.left_ms / batch.work_ms if batch.work_ms > 0 else 1.0
        else:
            span_s = batch.end_s - batch.started_s
            done = min(1.0, (self.now - batch.started_s) / span_s) if span_s > 0 else 1.0
        added_ms = (done * c.step_ms + (1 - done) * c.decode_token_ms * len(decoding)) * share
        batch.work_ms += added_ms
        if self.fluid:  # `_reschedule` sets its new end
            batch.left_ms += added_ms
        else:
            batch.end_s += added_ms * self._sharing(client=self.client_free_s > self.now) / 1000
        for running in decoding:
            running.in_flight = True
            batch.items.append((running, 1))

    def _overtake(self, batch: _Batch, decoding: list[_Running], share: float, members: int, last: bool) -> None:
        """Decode steps `decoding` pass `batch`, a prompt chunk's batch computing on a member with `share` of the
        blocks of a unit of `members`: they compute at once in a batch of their own, and `batch` ends that much later
        (its wall time and work count theirs); unless steps passed it already, its first block is not done yet, or
        what is left of `batch` is less than `overtake_gain` x a lone decode step's time through the member's blocks:
        they join it then (a chunk is passed once, not before its pace is known, and not near its end), as the
        servers' `StepScheduler._passes` has it [before stop 69's report: less than the gain x their whole batch's
        time, which refused the passes of a burst's wide gangs of steps: 1-2 of 19-22 chunks at r89's peak against 9
        of 19-23 live]."""
        if not decoding:
            return
        c = self.config
        items = [(running, 1) for running in decoding]
        work_ms, remote = self._work(items, members)
        work_ms = self._noisy(work_ms) * share
        sharing = self._sharing(client=self.client_free_s > self.now)
        compute_ms = work_ms * sharing
        lone_ms = self._work(items[:1], members)[0] * share * sharing
        span_s = batch.end_s - batch.started_s
        first_block = (self.now - batch.started_s) * max(1, round(share * c.blocks)) < span_s
        if batch.passed or first_block or (batch.end_s - self.now) * 1000 < c.overtake_gain * lone_ms:
            self._join(batch, decoding, share)
            return
        for running in decoding:
            running.in_flight = True
        ahead = _Batch(batch.uid, batch.member, last, items, self.now, passing=True)
        ahead.tail_ms = ahead.hops_ms = 2 * remote * share * c.hop_ms
        ahead.end_s = self.now + (compute_ms + ahead.tail_ms) / 1000
        batch.passed = True
        batch.work_ms += work_ms
        if self.fluid:  # `_reschedule` sets its new end
            batch.left_ms += work_ms
        else:
            batch.end_s += compute_ms / 1000
        self._push(ahead.end_s, "step", batch.member, ahead)

    def _start_micro_batches(self, unit: _Unit) -> None:
        """Starts micro-batches on `unit` while it has a free pipeline slot and ready requests: a group of k members
        keeps up to k in flight, each with about 1/k of its requests, each crossing the k members and paying their
        (k - 1) hops [chosen: no bubbles; the hops count in the occupancy, which keeps a pipeline's micro-batches
        whole]."""
        c = self.config
        slots = len(unit.members)
        share = max(1, math.ceil(len(unit.running) / slots))
        while unit.batches < slots:
            idle = [r for r in unit.running if not (r.in_flight or r.closing or r.at_client)]
            ready = [r for r in idle if r.ready_s <= self.now]
            if not ready:
                self._wake(unit, [r.ready_s for r in idle])
                return
            items = self._batch(ready[:share], unit)
            if not items:
                return
            work_ms, remote = self._work(items, slots)
            work_ms = self._noisy(work_ms)
            unit.batches += 1
            compute_ms = work_ms * self._sharing(client=self.client_free_s > self.now)
            step_s = (compute_ms + (slots - 1 + 2 * remote) * c.hop_ms) / 1000
            self._push(self.now + step_s, "step", unit.uid, _Batch(unit.uid, MICRO_BATCH, True, items))

    def _batch(self, ready: Sequence[_Running], unit: _Unit) -> list[tuple[_Running, int]]:
        """Gives a batch of the `ready` steps of `unit`, (request, tokens) each, and marks them in flight: every
        decoding step, and the next chunks of prompts (of their current pass) within `prefill_chunk_tokens`; with
        `reserve_decode_rows`, as the swarm's servers form it (`_reserved_batch`)."""
        if self.config.reserve_decode_rows:
            items = self._reserved_batch(ready, unit)
        else:
            budget = self.config.prefill_chunk_tokens
            items = []
            for running in ready:
                if running.prefilled < running.request.prompt:
                    if budget <= 0:
                        continue
                    chunk = min(budget, self._pass_left(running))
                    budget -= chunk
                    items.append((running, chunk))
                else:
                    items.append((running, 1))
        for running, _ in items:
            running.in_flight = True
        return items

    def _reserved_batch(self, ready: Sequence[_Running], unit: _Unit) -> list[tuple[_Running, int]]:
        """Gives a batch of the `ready` steps as a swarm server's scheduler forms it (`StepScheduler._next_batch`):
        decode steps first, a token each of `prefill_chunk_tokens`, then prompt chunks, each leaving a token of the
        budget for every request of `unit` not in the batch yet (`ready` are some of them; its own included: the live
        scheduler counts every session active in the last second, and each of those steps or opened that recently),
        whose decode steps may join it; a prompt with no room left waits, unless the batch is empty (then it takes
        one token)."""
        budget = self.config.prefill_chunk_tokens
        items: list[tuple[_Running, int]] = []
        decoding = [running for running in ready if running.prefilled >= running.request.prompt]
        prompts = [running for running in ready if running.prefilled < running.request.prompt]
        for running in decoding + prompts:
            take = 1
            if running.prefilled < running.request.prompt:
                room = budget - (len(unit.running) - len(items))
                take = min(self._pass_left(running), room)
                if take < 1:
                    if items:
                        continue
                    take = 1
            items.append((running, take))
            budget -= take
            if budget <= 0:
                break
        return items

    @staticmethod
    def _pass_left(running: _Running) -> int:
        """Gives the prompt tokens of `running`'s current pass not computed yet at its member."""
        return running.request.prompt - running.prefilled - running.pass_done

    def _work(self, items: Sequence[tuple[_Running, int]], members: int) -> tuple[float, int]:
        """Gives what a batch of `items` on a unit of `members` costs through all blocks (ms, before any sharing), and
        the most blocks one of them attends remotely."""
        c = self.config
        prefill_token_ms = c.prefill_token_ms if members == 1 or c.member_prefill_token_ms is None \
            else c.member_prefill_token_ms
        prefill = sum(count for running, count in items if running.prefilled < running.request.prompt)
        decode = sum(1 for running, _ in items if running.prefilled >= running.request.prompt)
        remote = max((r.remote_blocks for r, _ in items if r.remote_until_s > self.now), default=0)
        rows_ms = c.decode_token_ms * decode if prefill else decode_rows_ms(c, decode)
        return c.step_ms + prefill_token_ms * prefill + rows_ms, remote

    def _noisy(self, work_ms: float) -> float:
        """Gives `work_ms` times this batch's draw of `work_noise` (a lognormal factor of mean 1)."""
        sigma = self.config.work_noise
        return work_ms * self.noise.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else work_ms

    def _wake(self, unit: _Unit, ready_s: list[float]) -> None:
        """Has `unit` start again when the first of steps not ready yet (`ready_s`) is, unless a wake-up is due
        sooner."""
        first = min(ready_s, default=math.inf)
        if first < (unit.wake_s if unit.wake_s is not None else math.inf):
            unit.wake_s = first
            self._push(first, "wake", unit.uid)

    def _share(self, member: int, members: int) -> float:
        """Gives the share of the model's blocks `member` computes in a unit of `members`."""
        if members == 1:
            return 1.0
        start, end = self.kept[member]
        return (end - start) / self.config.blocks

    def _sharing(self, *, client: bool) -> float:
        """Gives how many times its own time work that starts now takes: the processes computing (the members
        computing a batch, the client if `client`) and the cores the refused tries and the tokens of the last second
        keep busy (times `other_work_weight`), n, over `cores`, at least 1, and `corun_stretch` once n reaches
        `cores` (linear from n = 1); 1 without `cores`."""
        cores = self.config.cores
        if cores is None:
            return 1.0
        busy = len(self.computing) + sum(unit.batches for unit in self.units.values())
        demand = busy + client + self.config.other_work_weight * (self._refused_load() + self._token_load())
        every_core = min(1.0, max(0.0, (demand - 1) / (cores - 1))) if cores > 1 else float(demand >= 1)
        return max(1.0, demand / cores) * (1 + (self.config.corun_stretch - 1) * every_core)

    def _advance(self) -> None:
        """With `fluid_sharing`: the members' batches progress to now at the speed they shared since `advanced_s`, their
        compute first, then their hops' delay."""
        elapsed_ms = (self.now - self.advanced_s) * 1000
        self.advanced_s = self.now
        if not self.fluid or elapsed_ms <= 0:
            return
        for batch in self.computing.values():
            computed_ms = min(batch.left_ms, elapsed_ms / self.stretch)
            batch.left_ms -= computed_ms
            batch.tail_ms = max(0.0, batch.tail_ms - (elapsed_ms - computed_ms * self.stretch))

    def _reschedule(self) -> None:
        """With `fluid_sharing`: the processes that compute now share the cores from now on (processor sharing, taken
        again at every event): each member's batch ends when what is left of it has run at that speed, then its hops'
        delay."""
        if not self.fluid:
            return
        self.stretch = self._sharing(client=self.client_free_s > self.now)
        for member, batch in self.computing.items():
            end_s = self.now + (batch.left_ms * self.stretch + batch.tail_ms) / 1000
            if abs(end_s - batch.end_s) > RESCHEDULE_TOLERANCE_S:
                batch.end_s = end_s
                self._push(end_s, "step", member, batch)

    def _token_load(self) -> float:
        """Gives the cores that the tokens of the last `TOKEN_LOAD_WINDOW_S` keep busy outside the modelled work."""
        tokens = self.tokens_seen
        while tokens and tokens[0] <= self.now - TOKEN_LOAD_WINDOW_S:
            tokens.popleft()
        return len(tokens) * self.config.token_cpu_ms / 1000 / TOKEN_LOAD_WINDOW_S

    def _refused_load(self) -> float:
        """Gives the cores that the tries refused in the last `REFUSED_LOAD_WINDOW_S` keep busy on average."""
        tries = self.refused_tries
        while tries and tries[0] <= self.now - REFUSED_LOAD_WINDOW_S:
            tries.popleft()
        return len(tries) * self.config.refused_try_cpu_ms / 1000 / REFUSED_LOAD_WINDOW_S

    def _finish_step(self, batch: _Batch) -> None:
        """A member's batch ended: its steps go on to the next member, or, from the last, their tokens to the client.
        A step whose unit was replaced meanwhile (a drop, a restore) starts its pass again on its new unit, unless
        it had reached the last member."""
        c = self.config
        replaced = batch.uid not in self.units
        if batch.member == MICRO_BATCH:
            if not replaced:
                self.units[batch.uid].batches -= 1
        elif not batch.passing:  # a passing batch's time counts in the chunk's that it passed
            self.computing.pop(batch.member, None)
            self.batch_wall_ms += (self.now - batch.started_s) * 1000 - batch.hops_ms
            self.batch_work_ms += batch.work_ms
        batch.done = True
        tokens = []
        for running, count in batch.items:
            running.in_flight = False
            if running.stopped:  # a drop caught its prompt in this batch: what it computed is lost
                running.stopped = False
                self._stop_prompt(running)
                continue
            prefill = running.prefilled < running.request.prompt
            if not batch.last:
                if replaced:
                    self._restart_pass(running)
                    continue
                if prefill:
                    running.pass_done += count
                    if running.pass_done < running.request.prompt - running.prefilled:
                        continue
                    running.pass_done = 0
                running.stage += 1
                if prefill:  # a prompt's hidden states go through the client, a decode step is pushed
                    at_client_s = self._cross("down", running, self.now) + c.hop_ms / 1000
                    arrived_s = self._cross("up", running, at_client_s) + c.hop_ms / 1000
                else:
                    arrived_s = self.now + c.hop_ms / 1000
                running.ready_s = max(running.ready_s, arrived_s)
                continue
            if prefill:
                running.prefilled += count
                if running.prefilled < running.request.prompt:
                    if replaced:
                        self._restart_pass(running)
                    continue
            running.stage = 0
            tokens.append(running)
        if tokens and c.client_gang_wait_s > 0:
            self._gang(batch.uid, tokens)
        else:
            self._client_pass(tokens)
        self._start_all()

    def _start_all(self) -> None:
        for unit in list(self.units.values()):  # no pages return here: only closes free them
            self._start(unit)

    def _gang(self, uid: int, tokens: list[_Running]) -> None:
        """Tokens of unit `uid` reached the client: they wait there, with those of the unit that came before, for
        the unit's other decode steps still on their way, at most `client_gang_wait_s` from the first; then one
        pass takes them all (`client.batched_head`). A prompt's first token waits too, but no one waits for one."""
        if uid not in self.gangs:
            deadline_s = self.now + self.config.client_gang_wait_s
            self.gangs[uid] = (deadline_s, [])
            self._push(deadline_s, "gang", uid)
        gang = self.gangs[uid][1]
        gang.extend(tokens)
        for running in tokens:
            running.at_client = True
        unit = self.units.get(uid)
        arrived = {running.index for running in gang}
        if unit is None or all(r.index in arrived or r.closing or r.produced == 0 for r in unit.running):
            del self.gangs[uid]
            self._client_pass(gang)

    def _client_pass(self, tokens: list[_Running]) -> None:
        """One pass of the client's head over `tokens` (after the passes before it): each is seen a round trip
        later, and its next step is on its way then."""
        c = self.config
        if tokens:
            client_ms = (c.client_pass_ms + c.client_token_ms * len(tokens)) * self._sharing(client=True)
            self.client_free_s = max(self.client_free_s, self.now) + client_ms / 1000
            if c.token_cpu_ms > 0 and c.cores is not None:
                self.tokens_seen.extend([self.now] * len(tokens))
            if self.fluid:  # the members' batches speed up once the client is idle
                self._push(self.client_free_s, "client idle", 0)
        seen_s = self.client_free_s + self._round_trip_ms() / 1000
        for running in tokens:
            request = running.request
            running.at_client = False
            if running.produced >= 1:
                running.interval_s = averaged_interval(running.interval_s, seen_s - running.last_seen_s)
            running.last_seen_s = seen_s
            running.produced += 1
            running.ready_s = max(running.ready_s, seen_s)  # its next step is on its way
            if running.first_token_s is None:
                running.first_token_s = seen_s
                self.ttft[running.index] = seen_s - request.arrival_s
            if running.produced >= max(1, request.output):
                running.closing = True
                if request.output > 1:
                    self.tbt[running.index] = (seen_s - running.first_token_s) / (request.output - 1)
                self._push(seen_s + c.round_trip_ms / 2000, "close", running.index)

    def _round_trip_ms(self) -> float:
        """Gives a token's delay outside the modelled work now: `round_trip_ms`, and `round_trip_per_decoding_ms` for
        each other request decoding (at most `round_trip_crowd_cap`)."""
        c = self.config
        if not c.round_trip_per_decoding_ms:
            return c.round_trip_ms
        decoding = sum(1 for unit in self.units.values() for running in unit.running
                       if running.produced >= 1 and not running.closing)
        return c.round_trip_ms + c.round_trip_per_decoding_ms * min(c.round_trip_crowd_cap, max(0, decoding - 1))

    def _close(self, index: int) -> None:
        """The client of request `index` closed its session: its pages return to whichever unit holds it now."""
        for unit in self.units.values():
            unit.running = [r for r in unit.running if r.index != index]
        self.done += 1
        self._serve()

    # ---- the monitor: drops and restores

    def _monitor(self) -> None:
        c = self.config
        held = sum(u.held for u in self.units.values())
        queued = sum(c.pages_of(self.requests[i]) for i in self.queue)
        queued += sum(c.pages_of(self.requests[i]) for i, (_, refused_s) in self.backing_off.items()
                      if self.now - refused_s <= c.refused_window_s)
        capacity = sum(u.capacity for u in self.units.values())
        self.demand.append((self.now, held + queued))
        self.available.append((self.now, capacity))
        del self.demand[:stale_count(self.demand, c.restore_calm_s)], self.available[:-2]
        self.samples.append((self.now, held + queued, capacity))
        if not c.dropping or c.static_groups > 1:
            return
        if self.dropped_at is not None:
            undropped = c.replicas * (c.pages_total - c.params_pages)
            if restore_trigger(self.demand, undropped, self.now - self.dropped_at,
                               min_dropped_s=c.restore_after_s, calm_s=c.restore_calm_s):
                self._restore()
                return
        required = drop_trigger(self.demand, self.available)
        if required > 0:
            self._drop(required)

    def _drop(self, required: int) -> None:
        """Frees `required` more pages: merges the replicas still whole into buddy groups (`plan_drop`), or, with
        fewer than two whole, merges the smallest groups formed earlier (`plan_merge`, Alg. 1 continued: pairs into
        fours, ...), each member keeping a part of its slice."""
        c = self.config
        whole = [unit for unit in self.units.values() if len(unit.members) == 1]
        if len(whole) >= 2:
            replicas = [self._replica(unit.members[0], unit) for unit in whole]
            plan = plan_drop(replicas, required, balanced=c.balanced, epoch=self.drops + 1)
            merging = whole
        else:
            units = list(self.units.values())
            replicas = [self._replica(member, unit) for unit in units for member in unit.members]
            kept = {_peer(member): self.kept[member] for unit in units for member in unit.members}
            plan = plan_merge(replicas, [[_peer(member) for member in unit.members] for unit in units], kept,
                              required, epoch=self.drops + 1)
            merging = units
        formed = {frozenset(group.members): group for group in plan.groups}
        changed = [unit for unit in merging if frozenset(_peer(m) for m in unit.members) not in formed]
        if not changed:
            return
        by_member = {member: unit for unit in changed for member in unit.members}
        for unit in changed:
            del self.units[unit.uid]
        for group in plan.groups:
            members = tuple(int(peer[1:]) for peer in group.members)  # in slice order
            if not set(members) <= set(by_member):
                continue
            merged = self._add_unit(members)
            for old in sorted({by_member[member].uid: by_member[member] for member in members}.values(),
                              key=lambda unit: unit.uid):
                for until_s, pages in old.copies:  # an earlier drop's exchange still crossing: its copies come along
                    merged.copies.append((until_s, pages))
                    self._push(until_s, "copied", merged.uid)
                moves = [(member, (self.kept[member][1] - self.kept[member][0])
                          - (plan.kept[_peer(member)][1] - plan.kept[_peer(member)][0])) for member in old.members]
                for running in sorted(old.running, key=lambda r: (r.pages, r.index)):
                    stopped = c.stopped_prompt_follow_ms is not None and running.prefilled < running.request.prompt
                    if stopped:  # the servers stop its prompt: its session stays at the start, with no KV to move
                        self._stop_prompt(running)
                    done = self._stall_victim(running, moves)
                    if c.exchange_transient and done > self.now:
                        moved = sum(blocks for _, blocks in moves if blocks > 0)
                        merged.copies.append((done, math.ceil(running.pages * moved / c.blocks)))
                        self._push(done, "copied", merged.uid)
                    if not stopped:
                        self._moved(running)  # its pass starts again on the group's first member
                    merged.running.append(running)
            self.largest_group = max(self.largest_group, len(members))
        for peer, kept_range in plan.kept.items():
            self.kept[int(peer[1:])] = kept_range
        self._serve()
        self.dropped_at = self.now
        self.drops += 1
        self.available.clear()  # it jumped: a rate across the drop means nothing; demand's does (as the live loop)

    def _replica(self, member: int, unit: _Unit) -> SegmentReplica:
        c = self.config
        return SegmentReplica(_peer(member), 0, c.blocks, c.params_pages_per_block,
                              pages_free=unit.free // len(unit.members), pages_kv=unit.held // len(unit.members))

    def _stall_victim(self, running: _Running, moves: list[tuple[int, int]]) -> float:
        """Blocking exchange: the victim's KV for the blocks each member (`moves`: member, blocks) no longer keeps
        crosses that member's link after the smaller victims' KV (the caller goes smallest first), the members'
        links in parallel; it computes nothing meanwhile. Live exchange: it computes on, attending remotely over
        those blocks until its KV has crossed (no stall). Gives when its KV has crossed."""
        c = self.config
        tokens = running.prefilled + running.produced
        done = self.now
        for member, blocks in moves:
            if blocks <= 0:
                continue
            seconds = tokens * blocks * c.kv_bytes_per_token_block / c.link_bytes_per_s
            self.link_free_s[member] = max(self.now, self.link_free_s.get(member, 0.0)) + seconds
            done = max(done, self.link_free_s[member])
        if c.live_exchange:
            running.remote_until_s = done
            running.remote_blocks = sum(blocks for _, blocks in moves if blocks > 0)
            self.stalls.append(0.0)
            return done
        running.ready_s = max(running.ready_s, done)
        self.stalls.append(done - self.now)
        return done

    def _copied(self, uid: int) -> None:
        """A victim's KV has crossed (`exchange_transient`): the pages its copy held on unit `uid` come free, and the
        requests waiting for room are served."""
        unit = self.units.get(uid)
        if unit is not None:
            unit.copies = [(until_s, pages) for until_s, pages in unit.copies if until_s > self.now]
            self._serve()

    def _restore(self) -> None:
        members = [member for unit in self.units.values() for member in unit.members]
        c = self.config
        room = {member: c.pages_total - c.params_pages for member in members}
        placed: dict[int, list[_Running]] = {member: [] for member in members}
        for running in sorted((r for u in self.units.values() for r in u.running), key=lambda r: (r.pages, r.index)):
            target = max(room, key=lambda member: (room[member], -member))
            if room[target] < running.pages:
                return  # the groups' requests do not fit on whole replicas yet: stay dropped
            room[target] -= running.pages
            self._moved(running)
            placed[target].append(running)
        self.units = {}
        for member in sorted(members):
            self._add_unit((member,)).running.extend(placed[member])
            self.kept[member] = (0, c.blocks)
        self._serve()
        self.dropped_at = None
        self.restores += 1
        self.available.clear()

    def _serve(self) -> None:
        """Admits the queued requests that now fit and starts every unit's ready steps (after a close, a drop or a
        restore; a step still computing on a unit that was replaced credits its requests when it ends)."""
        self._dispatch()
        for unit in list(self.units.values()):
            self._start(unit)


def _peer(member: int) -> str:
    return f"r{member:04d}"


def _even_slice(blocks: int, members: int, index: int) -> tuple[int, int]:
    """Gives the blocks the `index`-th of `members` members keeps when they tile `blocks` evenly."""
    return blocks * index // members, blocks * (index + 1) // members


def decode_rows_ms(config: KunServeSimConfig, rows: int) -> float:
    """Gives what `rows` decoding requests cost a batch without prompt tokens through all blocks beyond its `step_ms`
    (`KunServeSimConfig.decode_rows_ms`: along the last two points' slope beyond them; without points,
    `decode_token_ms` each)."""
    if not config.decode_rows_ms:
        return config.decode_token_ms * rows
    return _through(config.decode_rows_ms, rows, extend=True)


def link_extra_s(points: Sequence[tuple[int, float]], size: int) -> float:
    """Gives what a message of `size` bytes takes beyond its bytes at the link's rate, by `points` (`KunServeSimConfig.
    client_link_extra_s`): at the largest one's beyond it; 0 without points."""
    return _through(points, size) if points else 0.0


def _through(points: Sequence[tuple[int, float]], x: float, *, extend: bool = False) -> float:
    """Gives the value at `x` of the line through (0, 0) and `points` (rising x): linear between them, beyond the last
    at its value, or with `extend` along the last two's slope."""
    xs, ys = zip(*((0, 0.0), *points), strict=True)
    if extend and x > xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    return float(np.interp(x, xs, ys))
