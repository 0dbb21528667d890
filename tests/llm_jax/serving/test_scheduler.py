"""The scheduler by hand-checked cases, and a randomized workload against a fake paged model whose
output is checked against each request run alone."""

import hashlib
import random

import numpy as np
import pytest

from llm_jax.serving import NULL_BLOCK, FinishReason, Request, RequestStatus, Scheduler, StepPlan
from llm_jax.serving.blocks import cdiv

BS = 4  # block size in these tests
EOS = 0


def next_token(context: list[int], vocab: int) -> int:
    """The fake model: a deterministic function of the whole sequence so far."""
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def solo(prompt: list[int], max_new_tokens: int, vocab: int, stop_at_eos: bool = False) -> list[int]:
    """What the fake model produces for a request alone."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_new_tokens:
        tokens.append(next_token(tokens, vocab))
        if stop_at_eos and tokens[-1] == EOS:
            break
    return tokens[len(prompt):]


class FakeDevice:
    """A paged 'KV cache' holding each slot's token id. A step writes the plan's tokens to their slots,
    then reads every sampling sequence's context back through its block table: wrong slots, tables or
    prefix-cache blocks change the output."""

    def __init__(self, num_blocks: int, vocab: int):
        self.cache = np.full(num_blocks * BS, -1, np.int64)
        self.vocab = vocab

    def step(self, plan: StepPlan) -> np.ndarray:
        self.cache[plan.slots_T] = plan.token_ids_T
        sampled_B = np.full(plan.num_seqs, -1, np.int32)
        for b in np.flatnonzero(plan.samples_B):
            positions = np.arange(plan.seq_lens_B[b])
            slots = plan.block_tables_BX[b, positions // BS] * BS + positions % BS
            sampled_B[b] = next_token(self.cache[slots].tolist(), self.vocab)
        return sampled_B


    def verify(self, plan: StepPlan) -> list[list[int]]:
        """A step with proposals: each sampling sequence's tokens the way speculative decoding emits them
        (the proposals while each is the model's next token, then the model's own), read through the
        cache as ``step`` reads it, position by position."""
        self.cache[plan.slots_T] = plan.token_ids_T
        new = [[] for _ in plan.request_ids]
        for b in np.flatnonzero(plan.samples_B):
            n = int(plan.num_proposals_B[b])
            end = plan.query_start_B[b] + plan.num_tokens_B[b]
            proposals = plan.token_ids_T[end - n:end].tolist()
            for j in range(n + 1):
                positions = np.arange(plan.seq_lens_B[b] - n + j)
                slots = plan.block_tables_BX[b, positions // BS] * BS + positions % BS
                new[b].append(next_token(self.cache[slots].tolist(), self.vocab))
                if j == n or new[b][-1] != proposals[j]:
                    break
        return new


def run_step(scheduler: Scheduler, device: FakeDevice, stop_at_eos: bool = False):
    plan = scheduler.schedule()
    sampled_B = device.step(plan)
    stopped = {rid: FinishReason.EOS for rid, s, tok in zip(plan.request_ids, plan.samples_B, sampled_B)
               if stop_at_eos and s and tok == EOS}
    scheduler.update(plan, sampled_B, stopped)
    return plan


def run_until(scheduler: Scheduler, device: FakeDevice, done, max_steps: int = 200) -> StepPlan:
    """Runs steps until ``done(plan)`` holds for the last plan; fails after ``max_steps``."""
    for _ in range(max_steps):
        plan = run_step(scheduler, device)
        if done(plan):
            return plan
    pytest.fail(f"not done after {max_steps} steps")


def chunk_of(plan: StepPlan, rid: str) -> tuple[list[int], list[int]] | None:
    """(token ids, positions) the plan computes for ``rid``, or None if it is not in the plan."""
    if rid not in plan.request_ids:
        return None
    b = plan.request_ids.index(rid)
    span = slice(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b])
    return plan.token_ids_T[span].tolist(), plan.positions_T[span].tolist()


def make(rid: str, prompt, max_new_tokens: int | None) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, max_new_tokens=max_new_tokens)


# Admission and refusal.

def test_add_refuses_requests_that_can_never_complete():
    s = Scheduler(num_blocks=5, block_size=BS, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    with pytest.raises(ValueError, match=r"prompt of 10 tokens \+ max_new_tokens=23 = 33 exceeds max_model_len=32"):
        s.add(make("long", range(10), 23))
    with pytest.raises(ValueError, match=r"18 tokens need 5 blocks of 4, more than the pool's 4"):
        s.add(make("big", range(10), 8))
    with pytest.raises(ValueError, match="leaves no room"):
        s.add(make("full", range(32), None))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(make("empty", [], 4))
    with pytest.raises(ValueError, match="max_new_tokens=0 must be positive"):
        s.add(make("zero", [1], 0))
    s.add(make("fits", range(10), 7))  # 17 tokens: K/V for 16, exactly the pool
    with pytest.raises(ValueError, match="max_num_seqs=0 must be positive"):
        Scheduler(num_blocks=5, block_size=BS, max_num_seqs=0, max_num_batched_tokens=8, max_model_len=32)
    with pytest.raises(ValueError, match="already queued"):
        s.add(make("fits", [1], 1))
    assert s.num_waiting == 1


def test_max_new_tokens_none_runs_to_max_model_len():
    s = Scheduler(num_blocks=9, block_size=BS, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=12)
    request = make("r", [5, 6, 7], None)
    s.add(request)
    device = FakeDevice(9, vocab=50)
    run_until(s, device, lambda plan: not s.has_unfinished)
    assert request.max_new_tokens == 9 and len(request.output_token_ids) == 9
    assert request.finish_reason is FinishReason.LENGTH


def test_admission_is_first_come_first_served_within_max_num_seqs():
    s = Scheduler(num_blocks=32, block_size=BS, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    for rid, n in (("a", 2), ("b", 3), ("c", 1)):
        s.add(make(rid, range(1, 5), n))
    device = FakeDevice(32, vocab=50)
    assert run_step(s, device).request_ids == ("a", "b")  # c waits: two sequences at most
    assert run_step(s, device).request_ids == ("a", "b")  # a finishes (2 tokens)
    plan = run_step(s, device)
    assert plan.request_ids == ("b", "c") and plan.finished == ("a",)


def test_priorities_order_admission_and_preemption():
    """Lower priority values are admitted first (ties: first come), and under pressure the highest value
    is preempted, not the newest."""
    s = Scheduler(num_blocks=32, block_size=BS, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32)
    for rid, priority in (("a", 1), ("b", 0), ("c", -1), ("d", 0)):
        request = make(rid, range(1, 5), 1)
        request.priority = priority
        s.add(request)
    device = FakeDevice(32, vocab=50)
    assert [run_step(s, device).request_ids for _ in range(4)] == [("c",), ("b",), ("d",), ("a",)]
    # 6 usable blocks; a (priority 1) and b (0) of 4 + 8 tokens need 3 each at their end, c (-1) arrives last.
    s = Scheduler(num_blocks=7, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    device = FakeDevice(7, vocab=50)
    for rid, priority in (("a", 1), ("b", 0), ("c", -1)):
        request = make(rid, [10 * priority + j for j in range(20, 24)], 8)
        request.priority = priority
        s.add(request)
    assert run_step(s, device).request_ids == ("c", "b", "a")  # in priority order
    plan = run_until(s, device, lambda plan: plan.preempted)
    assert plan.preempted == ("a",) and plan.request_ids == ("c", "b")
    run_until(s, device, lambda plan: not s.has_unfinished)


def test_the_head_of_the_queue_is_never_overtaken():
    s = Scheduler(num_blocks=5, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    s.add(make("a", range(1, 11), 2))  # 3 of the 4 blocks, all it will need
    s.add(make("big", range(50, 58), 1))  # 2 blocks: must wait for a
    s.add(make("small", [1], 1))  # 1 block would fit, but comes after big
    device = FakeDevice(5, vocab=50)
    assert run_step(s, device).request_ids == ("a",)
    assert run_step(s, device).request_ids == ("a",)
    assert run_step(s, device).request_ids == ("big", "small")


# The plan's arrays.

def test_plan_arrays_by_hand():
    s = Scheduler(num_blocks=10, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    s.add(make("a", [10, 11, 12, 13, 14, 15], 4))
    s.add(make("b", [20, 21], 4))
    plan = s.schedule()
    assert plan.request_ids == ("a", "b")
    np.testing.assert_array_equal(plan.token_ids_T, [10, 11, 12, 13, 14, 15, 20, 21])
    np.testing.assert_array_equal(plan.positions_T, [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(plan.query_start_B, [0, 6])
    np.testing.assert_array_equal(plan.num_tokens_B, [6, 2])
    np.testing.assert_array_equal(plan.seq_lens_B, [6, 2])
    np.testing.assert_array_equal(plan.block_tables_BX, [[1, 2], [3, NULL_BLOCK]])
    np.testing.assert_array_equal(plan.slots_T, [4, 5, 6, 7, 8, 9, 12, 13])
    np.testing.assert_array_equal(plan.samples_B, [True, True])
    assert plan.token_ids_T.dtype == np.int32 and plan.block_tables_BX.shape == (2, 2)
    assert plan.preempted == () and plan.finished == ()
    s.update(plan, [16, 22])
    plan = s.schedule()
    np.testing.assert_array_equal(plan.token_ids_T, [16, 22])
    np.testing.assert_array_equal(plan.positions_T, [6, 2])
    np.testing.assert_array_equal(plan.slots_T, [2 * BS + 2, 3 * BS + 2])
    np.testing.assert_array_equal(plan.seq_lens_B, [7, 3])


def test_empty_plan():
    s = Scheduler(num_blocks=4, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8)
    plan = s.schedule()
    assert plan.num_seqs == 0 and plan.num_tokens == 0 and plan.block_tables_BX.shape == (0, 0)
    s.schedule()  # an empty plan needs no update


def test_schedule_and_update_alternate():
    s = Scheduler(num_blocks=4, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8)
    s.add(make("a", [1, 2], 3))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        s.schedule()
    with pytest.raises(ValueError, match="sampled has 2 sequences; the plan has 1"):
        s.update(plan, [1, 2])
    with pytest.raises(ValueError, match=r"not in this plan: \['z'\]"):
        s.update(plan, [1], {"z": FinishReason.EOS})
    s.update(plan, [1])
    with pytest.raises(ValueError, match="last schedule"):
        s.update(plan, [1])


# Chunked prefill.

def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    budget = 8
    s = Scheduler(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    device = FakeDevice(64, vocab=50)
    s.add(make("a", [1, 2], 20))
    s.add(make("b", [3, 4], 20))
    run_step(s, device)
    long_prompt = list(range(100, 130))
    s.add(make("long", long_prompt, 2))
    computed = 0
    for _ in range(5):
        plan = run_step(s, device)
        assert plan.request_ids == ("a", "b", "long") and plan.num_tokens <= budget
        np.testing.assert_array_equal(plan.num_tokens_B[:2], [1, 1])  # the decodes go on every step
        tokens, positions = chunk_of(plan, "long")
        assert len(tokens) == min(budget - 2, 30 - computed)
        assert tokens == long_prompt[computed:computed + len(tokens)]
        assert positions == list(range(computed, computed + len(tokens)))
        computed += len(tokens)
        assert plan.samples_B.tolist() == [True, True, computed == 30]
    assert computed == 30
    request = s.get("long")
    assert request.output_token_ids == (next_token(long_prompt, 50),)
    run_until(s, device, lambda plan: not s.has_unfinished)


def test_a_running_prefill_takes_what_the_budget_leaves():
    s = Scheduler(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    device = FakeDevice(64, vocab=50)
    s.add(make("p", range(1, 21), 1))  # 20 tokens
    s.add(make("q", range(1, 4), 1))
    plan = run_step(s, device)
    assert plan.request_ids == ("p",) and plan.num_tokens == 8  # p's first chunk takes the whole budget
    plan = run_step(s, device)
    assert plan.request_ids == ("p",) and plan.num_tokens == 8
    plan = run_step(s, device)  # p's last 4 tokens, then q in what is left
    assert plan.request_ids == ("p", "q") and plan.num_tokens_B.tolist() == [4, 3]


# Prefix caching.

@pytest.mark.parametrize("caching", [True, False])
def test_a_request_starts_from_its_cached_prefix(caching):
    s = Scheduler(num_blocks=32, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                  enable_prefix_caching=caching)
    device = FakeDevice(32, vocab=50)
    shared = list(range(1, 11))  # 10 tokens: 2 full blocks
    s.add(make("a", shared + [90], 3))
    run_until(s, device, lambda plan: not s.has_unfinished)
    s.add(make("b", shared + [91, 92], 3))
    tokens, positions = chunk_of(run_step(s, device), "b")
    hit = 8 if caching else 0
    assert positions[0] == hit and tokens == (shared + [91, 92])[hit:]
    stats = s.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == ((11 + 12, 8) if caching else (0, 0))
    run_until(s, device, lambda plan: not s.has_unfinished)
    assert not s.has_unfinished and stats.blocks_cached == (4 if caching else 0)


@pytest.mark.parametrize("caching", [True, False])
def test_requests_arriving_together_compute_a_shared_prefix_once(caching):
    """b shares a's first 3 blocks: it waits while a computes them (c, unrelated, goes ahead), then starts
    from them. Without the cache nobody waits."""
    s = Scheduler(num_blocks=32, block_size=BS, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                  enable_prefix_caching=caching)
    device = FakeDevice(32, vocab=50)
    shared = list(range(1, 13))  # 3 full blocks
    a, b, c = make("a", shared + [30, 31], 4), make("b", shared + [32], 2), make("c", [40, 41, 42], 2)
    for request in (a, b, c):
        s.add(request)
    first = run_step(s, device)  # a takes the whole budget (8 of its 14 tokens)
    assert first.request_ids == ("a",)
    second = run_step(s, device)  # a's last 6 tokens; b would recompute a's third block: it waits, c goes
    assert second.request_ids == (("a", "c") if caching else ("a", "b"))
    if caching:
        assert [r.request_id for r in s.waiting] == ["b"] and [r.request_id for r in s.running] == ["a", "c"]
        third = run_step(s, device)  # a's blocks are cached now: b starts from them
        tokens, positions = chunk_of(third, "b")
        assert positions[0] == 12 and tokens == [32]
        assert [r.request_id for r in s.running] == ["a", "b", "c"]  # arrival order
    run_until(s, device, lambda plan: not s.has_unfinished)
    for request in (a, b, c):
        assert request.output_token_ids == tuple(solo(list(request.prompt_token_ids), request.max_new_tokens, 50))
    assert s.stats().prefix_hit_tokens == (12 if caching else 0)


def test_a_fully_cached_prompt_recomputes_its_last_block():
    s = Scheduler(num_blocks=32, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    device = FakeDevice(32, vocab=50)
    prompt = list(range(1, 9))  # 2 full blocks
    first = make("a", prompt, 5)
    s.add(first)
    run_until(s, device, lambda plan: not s.has_unfinished)
    again = make("b", prompt, 5)
    s.add(again)
    tokens, positions = chunk_of(run_step(s, device), "b")
    assert positions == [4, 5, 6, 7] and tokens == prompt[4:]
    run_until(s, device, lambda plan: not s.has_unfinished)
    assert again.output_token_ids == first.output_token_ids == tuple(solo(prompt, 5, 50))


# Preemption.

def test_the_newest_is_preempted_and_recomputes_prompt_and_outputs():
    # 6 blocks; three requests of 4 + 8 tokens each need 3 blocks at their end: they cannot all run.
    s = Scheduler(num_blocks=7, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    device = FakeDevice(7, vocab=50)
    prompts = {rid: [10 * i + j for j in range(1, 5)] for i, rid in enumerate("abc", start=1)}
    requests = {rid: make(rid, prompt, 8) for rid, prompt in prompts.items()}
    for request in requests.values():
        s.add(request)
    plan = run_until(s, device, lambda plan: plan.preempted)
    c = requests["c"]
    # a needed the block; c, the newest, gave it.
    assert plan.preempted == ("c",) and plan.request_ids == ("a", "b")
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and s.waiting[0] is c
    assert s.kv.block_table("c") == () and s.stats().num_preemptions == 1
    produced = list(c.token_ids)
    assert len(produced) > 4
    plan = run_until(s, device, lambda plan: "c" in plan.request_ids)
    tokens, positions = chunk_of(plan, "c")
    # Readmitted: computes what the prefix cache lacks of its prompt and produced tokens, then samples.
    assert positions[-1] == len(produced) - 1 and tokens == produced[positions[0]:]
    assert plan.samples_B[plan.request_ids.index("c")]
    run_until(s, device, lambda plan: not s.has_unfinished)
    for rid, request in requests.items():
        assert list(request.output_token_ids) == solo(prompts[rid], 8, 50), rid
    assert s.pool.num_used == 0


def test_a_preempted_request_goes_back_to_the_front_and_nobody_is_admitted_that_step():
    s = Scheduler(num_blocks=7, block_size=BS, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=16)
    device = FakeDevice(7, vocab=50)
    prompts = {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24], "c": list(range(31, 39)), "d": [7]}
    requests = {rid: make(rid, prompt, {"c": 4, "d": 1}.get(rid, 8)) for rid, prompt in prompts.items()}
    for request in requests.values():
        s.add(request)  # d waits: max_num_seqs=3
    assert run_step(s, device).request_ids == ("a", "b", "c")
    plan = run_step(s, device)
    # c needs a third block after a and b took the last two: it is the newest, so it preempts itself.
    assert plan.preempted == ("c",) and plan.request_ids == ("a", "b")
    # Its two blocks are free now and d would fit, but a preemption means the pool is full.
    assert s.pool.num_free == 2 and "d" not in plan.request_ids
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    produced = list(requests["c"].token_ids)
    # a and b evict c's cached blocks as they grow; c waits for them, and d waits behind c.
    plan = run_until(s, device, lambda plan: {"c", "d"} & set(plan.request_ids))
    assert plan.request_ids == ("c", "d") and plan.finished == ("a", "b")
    assert chunk_of(plan, "c") == (produced, list(range(len(produced))))  # recomputed from scratch
    run_until(s, device, lambda plan: not s.has_unfinished)
    for rid, request in requests.items():
        assert list(request.output_token_ids) == solo(prompts[rid], request.max_new_tokens, 50), rid


def test_a_preempted_request_is_not_readmitted_in_the_step_that_preempted_it():
    # Without prefix caching and with a small budget, b would fit again at once in the blocks it gave up.
    s = Scheduler(num_blocks=5, block_size=BS, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=16,
                  enable_prefix_caching=False)
    device = FakeDevice(5, vocab=50)
    s.add(make("a", [1, 2, 3, 4], 8))
    s.add(make("b", [5, 6, 7, 8, 9], 8))
    plan = run_until(s, device, lambda plan: plan.preempted)
    assert plan.preempted == ("b",) and plan.request_ids == ("a",) and s.pool.num_free >= 1
    plan = run_step(s, device)
    assert plan.request_ids == ("a", "b") and chunk_of(plan, "b")[1][0] == 0
    run_until(s, device, lambda plan: not s.has_unfinished)
    assert s.pool.num_free == s.pool.capacity


# Finishing and aborting.

def test_update_finishes_at_the_length_limit_or_for_the_callers_reason():
    s = Scheduler(num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    a, b, c = make("a", [1], 1), make("b", [2], 5), make("c", [3], 5)
    for request in (a, b, c):
        s.add(request)
    plan = s.schedule()
    finished = s.update(plan, [7, 8, 9], {"b": FinishReason.EOS})
    assert finished == [a, b] and a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.EOS
    assert b.output_token_ids == (8,) and c.status is RequestStatus.RUNNING
    assert s.finish("c", FinishReason.STOP) and c.finish_reason is FinishReason.STOP
    assert s.schedule().finished == ("a", "b", "c")
    assert not s.has_unfinished and s.pool.num_used == 0


def test_abort_in_every_state():
    s = Scheduler(num_blocks=7, block_size=BS, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    device = FakeDevice(7, vocab=50)
    waiting, running, in_flight = make("w", [1, 2], 4), make("r", [3, 4], 4), make("f", [5, 6], 4)
    s.add(running)
    s.add(in_flight)
    s.add(waiting)  # max_num_seqs=2: stays waiting
    run_step(s, device)
    assert waiting.status is RequestStatus.WAITING and s.abort("w")
    assert running.status is RequestStatus.RUNNING and s.abort("r")
    plan = s.schedule()
    assert plan.finished == ("w", "r") and plan.request_ids == ("f",)
    assert s.abort("f")  # between its step's plan and the update: the update skips it
    output = in_flight.output_token_ids
    s.update(plan, [9])
    assert in_flight.output_token_ids == output
    for request in (waiting, running, in_flight):
        assert request.status is RequestStatus.FINISHED and request.finish_reason is FinishReason.ABORT
    assert not s.abort("f") and not s.abort("nobody")  # finished or unknown: nothing to do
    assert s.pool.num_used == 0 and not s.has_unfinished
    # A preempted request.
    s = Scheduler(num_blocks=7, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    for rid in "abc":
        s.add(make(rid, [ord(rid)] * 4, 8))
    plan = run_until(s, device, lambda plan: plan.preempted)
    [victim] = plan.preempted
    assert s.get(victim).status is RequestStatus.PREEMPTED and s.abort(victim)
    run_until(s, device, lambda plan: not s.has_unfinished)
    assert s.pool.num_used == 0 and s.pool.num_free == s.pool.capacity


# A randomized workload.

def check_plan(s: Scheduler, plan: StepPlan) -> None:
    """The invariants of one plan and of the pool after it is scheduled."""
    assert plan.num_tokens <= s.max_num_batched_tokens
    assert plan.num_seqs <= s.num_running <= s.max_num_seqs
    assert len(set(plan.request_ids)) == plan.num_seqs
    # Each token goes to its own slot, in a block its sequence owns alone that is not cached.
    assert len(np.unique(plan.slots_T)) == plan.num_tokens
    for slot in plan.slots_T:
        block = slot // BS
        assert block != NULL_BLOCK and s.pool.ref_count(block) == 1 and s.pool.block_hash(block) is None
    for b, rid in enumerate(plan.request_ids):
        request = s.get(rid)
        table = s.kv.block_table(rid)
        tokens, positions = chunk_of(plan, rid)
        # Blocks for the tokens it computes; beyond them at most those of proposals it made in an earlier
        # step (up to 4 in these tests: the table only grows, and it grows into them).
        assert cdiv(int(plan.seq_lens_B[b]), BS) <= len(table) <= cdiv(request.num_tokens + 4, BS)
        assert plan.block_tables_BX[b, :len(table)].tolist() == list(table)
        assert (plan.block_tables_BX[b, len(table):] == NULL_BLOCK).all()
        assert positions == list(range(plan.seq_lens_B[b] - len(positions), plan.seq_lens_B[b]))
        assert positions[0] == request.num_computed_tokens
        n = int(plan.num_proposals_B[b])  # proposals follow the known tokens, only for a decoding request
        assert tokens[:len(tokens) - n] == request.token_ids[positions[0]:positions[-1] + 1 - n]
        assert n == 0 or len(tokens) - n == 1
        span = slice(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b])
        expected = [table[p // BS] * BS + p % BS for p in positions]
        assert plan.slots_T[span].tolist() == expected
        assert plan.samples_B[b] == (plan.seq_lens_B[b] - n == request.num_tokens)
    check_pool(s)


def check_pool(s: Scheduler) -> None:
    """Reference counts are the live block tables' references; free blocks are exactly the others."""
    refs = np.zeros(s.pool.num_blocks, np.int64)
    for request in s.waiting + s.running:
        for block in s.kv.block_table(request.request_id):
            refs[block] += 1
    assert refs[NULL_BLOCK] == 0
    assert [s.pool.ref_count(b) for b in range(s.pool.num_blocks)] == refs.tolist()
    free = s.pool.eviction_order()
    assert len(set(free)) == len(free) and set(free) == set(np.flatnonzero(refs == 0)) - {NULL_BLOCK}
    shared = np.flatnonzero(refs > 1)
    assert all(s.pool.block_hash(b) is not None for b in shared)  # only cached (read-only) blocks are shared
    assert [r.rank for r in s.running] == sorted(r.rank for r in s.running)  # the one to preempt is last
    assert [r.rank for r in s.waiting] == sorted(r.rank for r in s.waiting)  # by priority, then arrival
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)


@pytest.mark.parametrize("seed, caching, priorities", [(0, True, False), (1, True, False), (2, False, False),
                                                       (3, True, True)])
def test_randomized_workload_matches_each_request_alone(seed, caching, priorities):
    rng = random.Random(seed)
    vocab, num_blocks, max_model_len = 6, 17, 48  # 16 blocks: one request of 48 tokens takes 12
    s = Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=5, max_num_batched_tokens=12,
                  max_model_len=max_model_len, enable_prefix_caching=caching)
    device = FakeDevice(num_blocks, vocab)
    prefixes = [[rng.randrange(1, 40) for _ in range(n)] for n in (0, 6, 13, 21)]
    requests: list[tuple[Request, bool]] = []  # (request, stops at EOS)
    stops = set()  # the requests that stop at EOS
    chunked = aborted = aborted_in_flight = 0
    for step in range(3000):
        if step < 400 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 12))]
            request = make(f"r{len(requests)}", prompt, rng.randint(1, max_model_len - len(prompt)))
            request.priority = rng.randint(-2, 2) if priorities else 0
            s.add(request)
            requests.append((request, rng.random() < 0.5))
            if requests[-1][1]:
                stops.add(request.request_id)
        if rng.random() < 0.03 and s.has_unfinished:
            aborted += s.abort(rng.choice([r.request_id for r in s.waiting + s.running]))
        if step >= 400 and not s.has_unfinished:
            break
        plan = s.schedule()
        check_plan(s, plan)
        chunked += int((~plan.samples_B).sum())
        sampled_B = device.step(plan)
        if rng.random() < 0.02 and plan.num_seqs:
            aborted_in_flight += s.abort(rng.choice(plan.request_ids))
        stopped = {rid: FinishReason.EOS for rid, samples, token in zip(plan.request_ids, plan.samples_B, sampled_B)
                   if samples and token == EOS and rid in stops}
        s.update(plan, sampled_B, stopped)
        check_pool(s)
    else:
        pytest.fail("the workload did not finish in 3000 steps")
    stats = s.stats()
    # The workload exercised what it is meant to.
    assert stats.num_preemptions > 10 and chunked > 10 and aborted + aborted_in_flight > 5
    assert (stats.prefix_hit_tokens > 100) == caching
    for request, stop_at_eos in requests:
        alone = solo(list(request.prompt_token_ids), request.max_new_tokens, vocab, stop_at_eos)
        assert request.status is RequestStatus.FINISHED
        if request.finish_reason is FinishReason.ABORT:
            assert list(request.output_token_ids) == alone[:len(request.output_token_ids)], request.request_id
        else:
            assert list(request.output_token_ids) == alone, request.request_id
            assert request.finish_reason is (FinishReason.EOS if alone[-1] == EOS and stop_at_eos
                                             else FinishReason.LENGTH)
    # Every block is free, held by no one; the prefix cache keeps what was not evicted.
    assert stats.blocks_in_use == 0 and s.pool.num_free == s.pool.capacity
    assert (stats.blocks_cached > 0) == caching


# Speculative decoding: proposals ride with a decoding request's latest token.

def test_proposals_are_planned_after_the_latest_token_within_the_budget():
    s = Scheduler(num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=32)
    s.add(make("a", [10, 11, 12], 10))
    s.update(s.schedule(), [13])
    s.get("a").spec_token_ids = [14, 15, 16, 17, 18]
    plan = s.schedule()
    # The latest token, then as many proposals as the budget of 4 leaves.
    np.testing.assert_array_equal(plan.token_ids_T, [13, 14, 15, 16])
    np.testing.assert_array_equal(plan.positions_T, [3, 4, 5, 6])
    np.testing.assert_array_equal(plan.num_proposals_B, [3])
    np.testing.assert_array_equal(plan.seq_lens_B, [7])
    assert plan.samples_B.tolist() == [True] and s.get("a").spec_token_ids == []
    s.update(plan, [[14, 15, 30]], accepted_B=[2])  # two accepted, then the model's own token
    a = s.get("a")
    assert a.output_token_ids == (13, 14, 15, 30) and a.num_computed_tokens == 6  # ... 13 14 15 cached
    stats = s.stats()
    assert (stats.spec_steps, stats.spec_proposed_tokens, stats.spec_accepted_tokens) == (1, 3, 2)
    assert stats.spec_accepted_per_position == (1, 1) and stats.mean_accepted_length == 3.0
    plan = s.schedule()  # the rejected proposal's slot is computed again, now for the token 30
    np.testing.assert_array_equal(plan.token_ids_T, [30])
    np.testing.assert_array_equal(plan.positions_T, [6])
    with pytest.raises(ValueError, match="3 new tokens after 0 proposals"):
        s.update(plan, [[1, 2, 3]])


def test_proposals_never_preempt():
    s = Scheduler(num_blocks=5, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    s.add(make("a", [1, 2, 3], 8))  # 4 blocks in the pool: "a" holds 1, "b" 2, then 3
    s.add(make("b", list(range(5, 13)), 4))
    s.update(s.schedule(), [4, 13])
    s.get("a").spec_token_ids = [5, 6, 7, 8, 9]  # would need 2 more blocks for "a"
    s.get("b").spec_token_ids = [14]  # fits in the block "b" takes for its latest token
    plan = s.schedule()
    assert plan.preempted == () and plan.num_proposals_B.tolist() == [0, 1]
    s.update(plan, [[5], [14, 20]])
    assert s.get("b").output_token_ids == (13, 14, 20) and s.get("a").output_token_ids == (4, 5)


def make_proposals(request: Request, expected: list[int], k: int, rng: random.Random) -> list[int]:
    """Up to k proposals: the request's true continuation, wrong from a random place on."""
    done = request.num_output_tokens
    proposals = expected[done:done + k]
    cut = rng.randrange(len(proposals) + 1)
    return proposals[:cut] + [(t + 1) % 7 for t in proposals[cut:]]


@pytest.mark.parametrize("seed, priorities", [(0, False), (1, True)])
def test_randomized_workload_with_proposals_matches_each_request_alone(seed, priorities):
    """Right and wrong proposals, preemptions, chunked prompts, the prefix cache and stops (and priorities):
    each request's tokens are what it produces alone, so accepted proposals keep their K/V and rejected
    ones' slots are recomputed."""
    rng = random.Random(seed)
    vocab, num_blocks, max_model_len = 6, 17, 48
    s = Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=5, max_num_batched_tokens=12,
                  max_model_len=max_model_len)
    device = FakeDevice(num_blocks, vocab)
    prefixes = [[rng.randrange(1, 40) for _ in range(n)] for n in (0, 6, 13)]
    requests, expected, stops = [], {}, set()
    for step in range(3000):
        if step < 300 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 12))]
            request = make(f"r{len(requests)}", prompt, rng.randint(1, max_model_len - len(prompt)))
            request.priority = rng.randint(-2, 2) if priorities else 0
            s.add(request)
            requests.append(request)
            stop_at_eos = rng.random() < 0.5
            expected[request.request_id] = solo(prompt, request.max_new_tokens, vocab, stop_at_eos)
            if stop_at_eos:
                stops.add(request.request_id)
        if step >= 300 and not s.has_unfinished:
            break
        for request in s.running:
            room = request.max_new_tokens - request.num_output_tokens - 1
            if request.num_computed_tokens == request.num_tokens - 1 and room > 0:
                request.spec_token_ids = make_proposals(request, expected[request.request_id], min(4, room), rng)
        plan = s.schedule()
        check_plan(s, plan)
        new = device.verify(plan)
        stopped = {}
        for b, rid in enumerate(plan.request_ids):
            if EOS in new[b] and rid in stops:
                new[b] = new[b][:new[b].index(EOS) + 1]
                stopped[rid] = FinishReason.EOS
        s.update(plan, new, stopped)
        check_pool(s)
    else:
        pytest.fail("the workload did not finish in 3000 steps")
    stats = s.stats()
    assert stats.num_preemptions > 5 and stats.spec_accepted_tokens > 100
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens
    for request in requests:
        assert list(request.output_token_ids) == expected[request.request_id], request.request_id
    assert stats.blocks_in_use == 0 and s.pool.num_free == s.pool.capacity
