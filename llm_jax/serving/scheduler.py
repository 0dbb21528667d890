"""Continuous batching on the host: which tokens of which requests the next device step computes.

Policy (that of vLLM v1): each step has one token budget, ``max_num_batched_tokens``. Running requests
take from it first, in order: a decoding request needs one token, one still prefilling takes a chunk of
what is left (chunked prefill, so a long prompt never stalls the others). Waiting requests are then
admitted in order while the budget, ``max_num_seqs`` and the free blocks allow, each starting from its
longest cached prefix and possibly with only a chunk of the rest. When a running request needs a block
and none is free, the last running request in that order is preempted: its blocks are freed and it goes
back to its place in the queue (usually its front), to recompute its prompt and the tokens it already
produced (much of it usually from the prefix cache) and continue. Its output is then what an
uninterrupted run gives, provided the device step computes each sequence independently of its batch.

The order is each request's ``priority`` (lower first, as vLLM's priority policy), then its arrival: with
every priority equal (0 by default), first come, first served, and the newest is preempted.

Speculative decoding: a decoding request may carry proposals for its next tokens (``spec_token_ids``,
set by the caller before ``schedule``). It is then scheduled for its latest token and as many proposals as
the budget allows, the step verifies them, and ``update`` takes the tokens it emitted (the accepted
proposals, then the model's own token): the K/V of the accepted ones are kept, the rejected ones' slots
are overwritten later.

The loop: ``plan = scheduler.schedule()``; the device step computes ``plan`` and samples a token for each
sequence with ``plan.samples_B`` (or verifies its proposals); ``scheduler.update(plan, sampled)``.
End-of-sequence and stop conditions are the caller's: it passes their reasons to ``update`` or calls
``finish``.
"""

import collections
import dataclasses
import enum
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from llm_jax.serving.blocks import NULL_BLOCK, ROOT_HASH, BlockHash, BlockPool, KVBlockManager, cdiv


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never ran
    RUNNING = "running"  # holds blocks and is scheduled each step the budget allows
    PREEMPTED = "preempted"  # queued again after its blocks were taken; recomputes when readmitted
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"  # an end-of-sequence id (decided by the caller)
    STOP = "stop"  # a stop id or string (decided by the caller)
    LENGTH = "length"  # max_new_tokens, or the model's context (max_model_len)
    ABORT = "abort"


@dataclasses.dataclass(kw_only=True, eq=False)
class Request:
    """One generation request. The scheduler owns it once added and advances its fields."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_new_tokens: int | None = None  # None: until the context is full (``add`` fills in the number)
    # Whether admission may start from the prefix cache (a request that needs every prompt position's
    # logits, for prompt log-probabilities, computes its whole prompt).
    use_prefix_cache: bool = True
    priority: int = 0  # lower goes first (admission, budget) and is preempted last; ties by arrival
    # The parent hash of its first block: another for requests whose K/V differ for equal tokens (a LoRA
    # adapter's, ``blocks.root_hash``), so the prefix cache never mixes them.
    hash_root: BlockHash = ROOT_HASH
    arrival: int = dataclasses.field(default=-1, init=False)  # order of ``add``
    token_ids: list[int] = dataclasses.field(init=False)  # the prompt, then every token produced so far
    # Proposed next tokens for the coming step (speculative decoding; the caller sets them, update clears).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list, init=False)
    num_computed_tokens: int = dataclasses.field(default=0, init=False)  # leading tokens whose K/V are cached
    status: RequestStatus = dataclasses.field(default=RequestStatus.WAITING, init=False)
    finish_reason: FinishReason | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        self.prompt_token_ids = tuple(int(t) for t in self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def rank(self) -> tuple[int, int]:
        """Its place in the scheduler's order: priority, then arrival."""
        return self.priority, self.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[len(self.prompt_token_ids):])


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What one device step computes, as numpy arrays to pad into buckets.

    B is the step's sequences (its batch: running requests first, then the ones admitted this step), T its
    tokens, flat and ragged (sequence b owns ``T[query_start_B[b] : query_start_B[b] + num_tokens_B[b]]``),
    X the widest block table. Every array is int32 but ``samples_B``.
    """

    request_ids: tuple[str, ...]  # B
    token_ids_T: np.ndarray  # the tokens whose K/V this step computes (and writes to slots_T), proposals last
    positions_T: np.ndarray  # each token's position in its sequence
    slots_T: np.ndarray  # where its K/V go in the flat cache: block * block_size + position % block_size
    query_start_B: np.ndarray  # where each sequence's tokens start in T
    num_tokens_B: np.ndarray  # how many tokens it computes this step (1 for a decode, a chunk when prefilling)
    seq_lens_B: np.ndarray  # its K/V length after this step: the keys its last token attends to
    block_tables_BX: np.ndarray  # its blocks in order, padded with NULL_BLOCK
    samples_B: np.ndarray  # bool: this step samples its next token, from its last token's logits (False
    #                        for a chunk short of the sequence's last known token: a prompt still prefilling)
    num_proposals_B: np.ndarray  # proposals among its last tokens (speculative decoding), to verify
    preempted: tuple[str, ...]  # requests preempted by this schedule (none of them is in B)
    finished: tuple[str, ...]  # requests finished or aborted since the previous plan

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids_T)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    num_waiting: int  # queued, preempted ones included
    num_running: int
    num_preemptions: int  # since start
    blocks_in_use: int  # referenced by a request
    blocks_cached: int  # findable by hash (in use or free)
    kv_usage: float  # blocks_in_use / the pool's capacity
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    # Speculative decoding: sequence steps that verified proposals, the proposals, the accepted ones, and
    # how often the proposal at each position (1st, 2nd, ...) was accepted.
    spec_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals per verified proposal (0 without speculation)."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted proposals plus the model's own token."""
        return 1 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption over a block pool of
    ``num_blocks`` blocks (one reserved) of ``block_size`` tokens."""

    def __init__(self, *, num_blocks: int, block_size: int = 16, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.kv = KVBlockManager(self.pool)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._requests: dict[str, Request] = {}  # not finished
        self._waiting: collections.deque[Request] = collections.deque()  # in order (``Request.rank``)
        self._running: list[Request] = []  # in order (``Request.rank``), so the one to preempt is last
        self._arrivals = itertools.count()
        self._finished_since_plan: list[str] = []
        self._pending: StepPlan | None = None  # the plan awaiting its update
        self._num_preemptions = 0
        self._spec_steps = self._spec_proposed = self._spec_accepted = 0
        self._spec_accepted_per_position: list[int] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """The queue, in admission order (preempted requests first)."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """The running requests, in order (priority, then arrival)."""
        return tuple(self._running)

    def get(self, request_id: str) -> Request | None:
        """A request not yet finished."""
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self._waiting), num_running=len(self._running), num_preemptions=self._num_preemptions,
            blocks_in_use=self.pool.num_used, blocks_cached=self.pool.num_cached, kv_usage=self.pool.usage,
            prefix_queried_tokens=self.pool.queried_tokens, prefix_hit_tokens=self.pool.hit_tokens,
            spec_steps=self._spec_steps, spec_proposed_tokens=self._spec_proposed,
            spec_accepted_tokens=self._spec_accepted,
            spec_accepted_per_position=tuple(self._spec_accepted_per_position))

    def add(self, request: Request) -> None:
        """Queues a new request, or refuses one that could never complete (ValueError naming the numbers)."""
        rid, num_prompt = request.request_id, len(request.prompt_token_ids)
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already queued or running")
        if request.status is not RequestStatus.WAITING or request.num_tokens != num_prompt:
            raise ValueError(f"request {rid!r} has already run (status {request.status.value})")
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        max_new_tokens = request.max_new_tokens
        if max_new_tokens is None:
            if num_prompt >= self.max_model_len:
                raise ValueError(f"request {rid!r}: its prompt of {num_prompt} tokens leaves no room for a new "
                                 f"token within max_model_len={self.max_model_len}")
            max_new_tokens = self.max_model_len - num_prompt
        if max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens={max_new_tokens} must be positive")
        total = num_prompt + max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens + max_new_tokens={max_new_tokens} "
                             f"= {total} exceeds max_model_len={self.max_model_len}")
        # The last token produced is never fed back, so K/V are cached for at most total - 1 tokens.
        blocks_needed = cdiv(total - 1, self.block_size)
        if blocks_needed > self.pool.capacity:
            raise ValueError(f"request {rid!r}: {total} tokens need {blocks_needed} blocks of {self.block_size}, "
                             f"more than the pool's {self.pool.capacity}")
        request.max_new_tokens = max_new_tokens
        request.arrival = next(self._arrivals)
        self._requests[rid] = request
        i = len(self._waiting)  # behind every request of its priority or a lower one
        while i and self._waiting[i - 1].rank > request.rank:
            i -= 1
        self._waiting.insert(i, request)

    def abort(self, request_id: str) -> bool:
        """Finishes a request in any state, freeing its blocks now. False if it is unknown or finished."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Finishes a request (for a reason the caller decided: EOS, a stop, an abort), freeing its blocks;
        its cached blocks stay findable. False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.kv.free(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self._finished_since_plan.append(request_id)
        return True

    def schedule(self) -> StepPlan:
        """Plans the next step (see the module docstring for the policy). Each non-empty plan must be given
        back to ``update`` before the next ``schedule``."""
        if self._pending is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        chunks: list[tuple[Request, int, list[int]]] = []  # (request, known tokens it computes, its proposals)
        preempted: list[str] = []
        budget = self._schedule_running(self.max_num_batched_tokens, chunks, preempted)
        if not preempted:  # a preemption means the pool is full: admit nobody this step
            self._admit_waiting(budget, chunks)
        plan = self._plan(chunks, preempted)
        self._finished_since_plan = []
        self._pending = plan if plan.num_seqs else None
        return plan

    def _schedule_running(self, budget: int, chunks: list[tuple[Request, int, list[int]]],
                          preempted: list[str]) -> int:
        """Gives each running request, in order, its next token (and its proposals, as far as the budget
        and the free blocks go) or prefill chunk, preempting the last while blocks lack. Returns the budget
        left."""
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            num_left = request.num_tokens - request.num_computed_tokens
            num_new = min(num_left, budget)
            spec = request.spec_token_ids[:budget - num_new] if num_new == num_left else []
            request.spec_token_ids = []
            end = request.num_computed_tokens + num_new
            if spec and not self.kv.allocate(request.request_id, end + len(spec)):
                spec = []  # proposals never preempt anyone
            while not self.kv.allocate(request.request_id, end):
                victim = self._running.pop()  # the last; never one already planned (they come before it)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget  # it was the newest: nobody is left after it
            chunks.append((request, num_new, spec))
            budget -= num_new + len(spec)
            i += 1
        return budget

    def _admit_waiting(self, budget: int, chunks: list[tuple[Request, int, list[int]]]) -> None:
        """Admits queued requests in order, each from its cached prefix, while the budget,
        ``max_num_seqs`` and the free blocks allow. A request whose next uncached block is one a running
        request is computing waits (later ones may go ahead): a step or a few later that block is cached,
        instead of computed twice (many requests with one long shared prefix arriving together)."""
        deferred: list[Request] = []
        try:
            while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
                request = self._waiting[0]
                prefix = (self.kv.cached_prefix(request.request_id, request.token_ids, request.hash_root)
                          if request.use_prefix_cache else [])
                if request.use_prefix_cache and self.kv.computing(request.request_id, len(prefix)):
                    deferred.append(self._waiting.popleft())
                    continue
                num_cached = len(prefix) * self.block_size
                num_new = min(request.num_tokens - num_cached, budget)
                if not self.kv.allocate(request.request_id, num_cached + num_new, prefix):
                    return  # nobody overtakes the head of the queue
                if self.pool.enable_prefix_caching:
                    self.pool.record_prefix_query(request.num_tokens, num_cached)
                self._waiting.popleft()
                request.status, request.num_computed_tokens = RequestStatus.RUNNING, num_cached
                self._insert_running(request)
                request.spec_token_ids = []
                chunks.append((request, num_new, []))
                budget -= num_new
        finally:
            self._waiting.extendleft(reversed(deferred))

    def _insert_running(self, request: Request) -> None:
        """Adds a request to the running ones, kept in order (one admitted ahead of a deferred request
        may still come before some running ones)."""
        i = len(self._running)
        while i and self._running[i - 1].rank > request.rank:
            i -= 1
        self._running.insert(i, request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
        request.spec_token_ids = []
        # Back in the queue in order: usually its front, behind any request before it still deferred.
        i = next((i for i, r in enumerate(self._waiting) if r.rank > request.rank), len(self._waiting))
        self._waiting.insert(i, request)
        self._num_preemptions += 1

    def _plan(self, chunks: list[tuple[Request, int, list[int]]], preempted: list[str]) -> StepPlan:
        num_proposals_B = np.array([len(spec) for _, _, spec in chunks], np.int32)
        num_tokens_B = np.array([n for _, n, _ in chunks], np.int32) + num_proposals_B
        start_B = np.array([r.num_computed_tokens for r, _, _ in chunks], np.int32)
        tables = [self.kv.block_table(r.request_id) for r, _, _ in chunks]
        block_tables_BX = np.full((len(chunks), max(map(len, tables), default=0)), NULL_BLOCK, np.int32)
        for b, table in enumerate(tables):
            block_tables_BX[b, :len(table)] = table
        seq_index_T = np.repeat(np.arange(len(chunks)), num_tokens_B)
        query_start_B = (np.cumsum(num_tokens_B) - num_tokens_B).astype(np.int32)
        positions_T = (np.arange(len(seq_index_T)) - query_start_B[seq_index_T] + start_B[seq_index_T])
        token_ids_T = [t for r, n, spec in chunks
                       for t in (*r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n], *spec)]
        slots_T = (block_tables_BX[seq_index_T, positions_T // self.block_size] * self.block_size
                   + positions_T % self.block_size)
        seq_lens_B = start_B + num_tokens_B
        return StepPlan(
            request_ids=tuple(r.request_id for r, _, _ in chunks),
            token_ids_T=np.array(token_ids_T, np.int32), positions_T=positions_T.astype(np.int32),
            slots_T=slots_T.astype(np.int32), query_start_B=query_start_B, num_tokens_B=num_tokens_B,
            seq_lens_B=seq_lens_B, block_tables_BX=block_tables_BX,
            samples_B=seq_lens_B - num_proposals_B == np.array([r.num_tokens for r, _, _ in chunks], np.int32),
            num_proposals_B=num_proposals_B, preempted=tuple(preempted), finished=tuple(self._finished_since_plan))

    def update(self, plan: StepPlan, sampled: Sequence | np.ndarray, stopped: Mapping[str, FinishReason] | None = None,
               *, accepted_B: Sequence[int] | np.ndarray | None = None) -> list[Request]:
        """Records that ``plan`` was computed: advances each sequence, appends its new tokens where
        ``plan.samples_B`` (other entries of ``sampled`` are ignored), caches its newly full blocks, and
        finishes requests at their length limit or named in ``stopped`` (the caller's EOS and stop
        decisions, which win over the length limit). Requests aborted since the plan are skipped.

        ``sampled``: one token per sequence ([B]) or, with proposals, each sequence's new tokens (its
        accepted proposals, then the model's own token; the caller may cut them after a stop).
        ``accepted_B``: how many proposals each sequence had accepted, for the counters (by default what
        its tokens show). Returns the requests this finished."""
        if plan.num_seqs and plan is not self._pending:
            raise ValueError("update() takes the plan of the last schedule()")
        if len(sampled) != plan.num_seqs:
            raise ValueError(f"sampled has {len(sampled)} sequences; the plan has {plan.num_seqs}")
        stopped = stopped or {}
        if unknown := set(stopped) - set(plan.request_ids):
            raise ValueError(f"stopped names requests not in this plan: {sorted(unknown)}")
        self._pending = None
        finished = []
        for b, rid in enumerate(plan.request_ids):
            request = self._requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            num_proposals = int(plan.num_proposals_B[b])
            tokens = [int(t) for t in np.atleast_1d(sampled[b])] if plan.samples_B[b] else []
            if len(tokens) > num_proposals + 1:
                raise ValueError(f"request {rid!r}: {len(tokens)} new tokens after {num_proposals} proposals")
            tokens = tokens[:request.max_new_tokens - request.num_output_tokens]
            # Its known tokens' K/V, and those of the proposals it accepted (they are its new tokens).
            num_kept = min(max(len(tokens) - 1, 0), num_proposals)
            request.num_computed_tokens += int(plan.num_tokens_B[b]) - num_proposals + num_kept
            request.token_ids.extend(tokens)
            self.kv.cache_full_blocks(rid, request.token_ids, request.num_computed_tokens, request.hash_root)
            if num_proposals and plan.samples_B[b]:
                accepted = num_kept if accepted_B is None else int(accepted_B[b])
                self._count_speculation(num_proposals, accepted)
            reason = stopped.get(rid)
            if reason is None and request.num_output_tokens >= request.max_new_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.finish(rid, reason)
                finished.append(request)
        return finished

    def _count_speculation(self, num_proposals: int, accepted: int) -> None:
        self._spec_steps += 1
        self._spec_proposed += num_proposals
        self._spec_accepted += accepted
        per_position = self._spec_accepted_per_position
        per_position.extend([0] * (accepted - len(per_position)))
        for i in range(accepted):
            per_position[i] += 1
