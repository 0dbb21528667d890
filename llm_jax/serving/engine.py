"""The serving engine: requests arrive at any time and run together, step by step, over a paged KV cache.

    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=256)
    engine.add_request("a", "Once upon a time", max_new_tokens=64)
    while engine.has_unfinished:
        for out in engine.step():       # each request's new tokens and text, and its finish reason
            ...

Each step the scheduler (host, :mod:`llm_jax.serving.scheduler`) plans which tokens run — one for every
decoding sequence, chunks of prompts while the token budget lasts — and the device step
(:mod:`llm_jax.serving.step`) runs them and picks each sequence's next token with the same processors and
sampling as ``generate``. End-of-sequence ids, stop ids and stop strings are checked here, on the host, as
``generate`` checks its text. Steps are padded to a few shapes, compiled once by :meth:`Engine.warm_up`.

With ``speculative=llm_jax.Speculative(method="ngram", num_tokens=k)`` each decoding request gets up to k
proposals before the step (prompt lookup in its tokens, here on the host); with ``method="draft"`` the
step itself draws them from the draft model, which keeps its own paged cache under the same block
tables. The scheduler budgets the proposals with the request's latest token, and the step verifies them
exactly (greedy output identical, sampled output with the model's own distribution). A request whose
proposals keep failing stops proposing for 1, 2, 4, ... steps (``Speculative.max_backoff`` at most).
Guided requests propose too: each verified position gets its own mask, what the constraint allows after
the proposals before it (the host computes them; n-gram proposals are first cut where the constraint
forbids one), and where such a request's proposals come from the draft, the draft runs first, as a
program of its own, for the host to see them.

With ``lora_adapters`` (PEFT folders or ``llm_jax.lora.LoraAdapter`` s) each request may name one
(``add_request(..., lora=name)``); requests of every adapter and of the base model run in the same steps
(:mod:`llm_jax.serving.adapters`), and the prefix cache keeps each adapter's blocks apart.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from llm_jax.decoding import PAD_ID, check_processors
from llm_jax.generation import Prompt, encode_prompts
from llm_jax.guided import Guided, Matcher, all_allowed, vocabulary
from llm_jax.kv_cache import PagedBatch, cache_bytes_per_token, cache_dtype, init_paged_cache
from llm_jax.loading import Model
from llm_jax.sampling import GREEDY, Sampling
from llm_jax.serving.adapters import AdapterArg, LoraSlots
from llm_jax.serving.blocks import NULL_BLOCK, ROOT_HASH, salted
from llm_jax.serving.scheduler import FinishReason, Request, Scheduler, SchedulerStats, StepPlan
from llm_jax.serving.step import Draft, Shape, StepInputs, abstract_inputs, draft_step, step, step_controls
from llm_jax.sharding import paged_cache_shardings
from llm_jax.speculative import Backoff, Method, Speculative, ngram_proposals
from llm_jax.stop_strings import SequenceText

BIAS_WIDTH = 300  # logit_bias entries per request at most (the OpenAI API's limit)
END_WIDTH = 32  # end-of-sequence and stop ids per request at most
MIN_TOKEN_BUCKET = 16  # the smallest token count a step with prefill chunks is padded to


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens (none for a prompt chunk that does not end the prompt)
    text: str  # new text, safe to show (held back where it could be the start of a stop string)
    finish_reason: str | None = None  # "eos", "stop", "length" when the request ended with this step
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: tuple[float, ...] | None = None  # the new tokens' log-probabilities, when asked for
    top_logprobs: tuple[dict[int, float], ...] | None = None
    # With the first token, when asked for: each prompt token's log-probability under the model (None for
    # the first, which nothing predicts) and the most likely tokens at its position.
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[dict[int, float] | None, ...] | None = None
    prompt_ranks: tuple[int | None, ...] | None = None  # each prompt token's rank (1: the most likely)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # after this step


class StepError(RuntimeError):
    """A step failed; the requests it ran (``request_ids``) were ended, the others go on."""

    def __init__(self, request_ids: Sequence[str], error: BaseException):
        super().__init__(f"a step of requests {list(request_ids)} failed: {error}")
        self.request_ids = tuple(request_ids)


@dataclasses.dataclass(eq=False)
class _Live:
    """Host state of one request beside the scheduler's."""

    request: Request
    sampling: Sampling
    end_ids: tuple[int, ...]  # EOS then stop ids, banned before min_new_tokens
    eos_ids: frozenset[int]
    stop_ids: frozenset[int]
    min_new_tokens: int
    logprobs: int | None
    sample_index: int
    text: SequenceText
    prompt_logprobs: int | None = None
    # By position: each prompt token's log-probability, rank and top tokens.
    prompt_scores: dict[int, tuple[float, int, dict[int, float]]] = dataclasses.field(default_factory=dict)
    backoff: Backoff = Backoff()  # speculative decoding: steps it proposes nothing after failures
    matcher: Matcher | None = None  # guided decoding: where the request stands in its constraint
    guided_after: int | None = None  # the token the constraint starts after (a reasoning's end), until it comes
    lora: str | None = None  # its LoRA adapter's name
    lora_slot: int = -1  # and its slot (-1: the base model)

    def guided_prefix(self, proposals: Sequence[int]) -> int:
        """How many of ``proposals``, from the first, its constraint allows (all before it starts)."""
        free = self._free(proposals)
        if self.matcher is None or free >= len(proposals):
            return len(proposals)
        return free + self.matcher.valid_prefix(proposals[free:])

    def fill_masks(self, rows_JW: np.ndarray, proposals: Sequence[int]) -> None:
        """Into row j of ``rows_JW`` (all ones; one more row than ``proposals``) what may follow
        ``proposals[:j]``: left all ones while its constraint has not started, then as
        :meth:`Matcher.fill_ahead` fills them."""
        free = self._free(proposals)
        if free < len(rows_JW):
            self.matcher.fill_ahead(rows_JW[free:], proposals[free:])

    def _free(self, proposals: Sequence[int]) -> int:
        """How many of ``proposals`` come before its constraint starts: none once started; up to its start
        token (included), or all, while that token has not come."""
        if self.guided_after is None:
            return 0
        proposals = list(proposals)
        return proposals.index(self.guided_after) + 1 if self.guided_after in proposals else len(proposals) + 1

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps compute prompt log-probabilities: asked for, and its prompt not yet done."""
        return self.prompt_logprobs is not None and self.request.num_output_tokens == 0

    @property
    def kind(self) -> str:
        if self.scores_prompt:
            return "prompt"
        if self.logprobs is not None:
            return "logprobs"
        greedy = dataclasses.replace(self.sampling, seed=0) == GREEDY
        return "greedy" if greedy and self.min_new_tokens == 0 and self.matcher is None else "sample"


def _buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit``."""
    sizes = [s for s in (2 ** i for i in range(32)) if smallest <= s < limit]
    return (*sizes, limit)


class Engine:
    """Continuous batching over a paged KV cache for ``model`` (its backend and weights).

    ``max_num_seqs`` sequences run at once; a step computes at most ``max_num_batched_tokens`` tokens (a
    token for each decoding sequence, chunks of prompts with the rest). The cache holds ``num_blocks``
    blocks of ``block_size`` tokens, or as many as ``kv_cache_memory`` bytes hold, or by default enough for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens (the model's context unless given).
    ``enable_prefix_caching`` keeps full blocks of finished requests for later ones with the same prefix.
    ``max_logprobs``: the most top log-probabilities a request may ask for. ``speculative``: proposals
    verified each step (n-gram prompt lookup or a draft model; see the module docstring).
    ``kv_cache_dtype``: what the cache holds, "int8" (a float32 scale per token and head: about half a
    bfloat16 cache's bytes, so ``kv_cache_memory`` holds about twice the blocks), "bfloat16" or "float32";
    None: the model's compute dtype. ``lora_adapters``: LoRA adapters requests may name (PEFT folders or
    ``LoraAdapter`` s), in ``max_loras`` slots (room for :meth:`add_lora` later), ranks up to
    ``max_lora_rank`` (see :class:`llm_jax.serving.adapters.LoraSlots`). ``logits_processors``: the caller's
    own (as ``generate``'s), applied to every request after the built-in processors; every step then runs
    the processors and sampling (no argmax-only steps); not with speculative decoding.
    """

    def __init__(self, model: Model, *, max_num_seqs: int = 8, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_batched_tokens: int = 256,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, max_logprobs: int = 20,
                 speculative: Speculative | None = None, kv_cache_dtype: str | None = None,
                 lora_adapters: Sequence[AdapterArg] = (), max_loras: int = 0, max_lora_rank: int | None = None,
                 logits_processors: Sequence[Callable] = ()):
        config = model.config
        config.check_language_model()
        self.processors = check_processors(logits_processors)
        if self.processors and speculative is not None:
            raise ValueError("logits_processors do not combine with speculative decoding")
        self.kv_cache_dtype = cache_dtype(config, kv_cache_dtype)
        self.model, self.config = model, config
        self.max_model_len = min(max_model_len or config.max_seq_len, config.max_seq_len)
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs, got "
                             f"{max_num_seqs=} {max_num_batched_tokens=}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.block_size, self.max_logprobs = block_size, max_logprobs
        self.speculative, self.draft = speculative, None
        if speculative is not None and Method(speculative.method) is Method.DRAFT:
            self.draft = speculative.draft_model
            if self.draft.config.vocab_size != config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.draft.config.vocab_size} tokens) is not the "
                                 f"model's ({config.vocab_size})")
            if self.draft.mesh is not None and self.draft.mesh != model.mesh:
                raise ValueError("the draft model must be on the model's mesh, or on one device (load it without "
                                 "a mesh: it is laid out on the model's)")
            if self.draft.mesh != model.mesh:  # the draft runs where the model does
                self.draft = self.draft.shard(model.mesh)
        self.lora = None
        if lora_adapters or max_loras:
            self.lora = LoraSlots(config, lora_adapters, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                  mesh=model.mesh)
        num_blocks = self._num_blocks(num_blocks, kv_cache_memory)
        self.cache = self._new_cache(num_blocks)
        self.draft_cache = None
        if self.draft is not None:  # the same blocks, for the draft's layers
            self.draft_cache = self._new_cache(num_blocks, draft=True)
        self.scheduler = Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   enable_prefix_caching=enable_prefix_caching)
        self.X = math.ceil(self.max_model_len / block_size)
        self.seq_buckets = _buckets(max_num_seqs)
        self.token_buckets = _buckets(max_num_batched_tokens, min(MIN_TOKEN_BUCKET, max_num_batched_tokens))
        self._live: dict[str, _Live] = {}

    def _new_cache(self, num_blocks: int, *, draft: bool = False):
        """The model's pages (``kv_cache_dtype``), or the draft model's (its compute dtype)."""
        config, dtype = (self.draft.config, None) if draft else (self.config, self.kv_cache_dtype)
        mesh = self.model.mesh  # with a mesh, pages split by K/V head as the params are
        sharding = None if mesh is None else paged_cache_shardings(config, num_blocks, self.block_size, mesh, dtype)
        cache = init_paged_cache(config, num_blocks, self.block_size, dtype, sharding=sharding)
        # Committed to its device, as every step's result is: the first step compiles what the others run.
        return cache if mesh is not None else jax.device_put(cache, jax.devices()[0])

    def _num_blocks(self, num_blocks: int | None, memory: int | None) -> int:
        per_block = cache_bytes_per_token(self.config, self.kv_cache_dtype) * self.block_size
        if self.draft is not None:
            per_block += cache_bytes_per_token(self.draft.config) * self.block_size
        if num_blocks is None and memory is not None:
            num_blocks = memory // per_block
        if num_blocks is None:
            num_blocks = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks of {self.block_size} tokens ({per_block} bytes "
                             f"each); got {num_blocks}")
        return int(num_blocks)

    # Requests.
    def add_request(self, request_id: str, prompt: Prompt, *, sampling: Sampling = GREEDY,
                    max_new_tokens: int | None = None, min_new_tokens: int = 0, stop: Sequence[str] = (),
                    stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, sample_index: int = 0, guided: Guided | None = None,
                    guided_after_token: int | None = None, skip_special_tokens: bool = True,
                    include_stop_str_in_output: bool = False, priority: int = 0, lora: str | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request (a string, or token ids used as given). ``max_new_tokens`` None: until the
        context is full. ``logprobs``: how many top alternatives to report per token (0: the token's own);
        ``prompt_logprobs``: the same for the prompt's tokens, reported with the first token (the request
        then computes its whole prompt, not starting from the prefix cache). ``sample_index`` tells apart
        the samples of one prompt drawn with one seed, as ``generate``'s ``n``. ``guided``: a constraint the
        output follows (``llm_jax.guided``: a JSON schema, a regular expression, choices, a grammar); the
        request ends once it is complete (finish reason "stop"); with speculative decoding its proposals are
        verified under the constraint, position by position.
        ``guided_after_token``: the constraint starts after this token (a thinking model's end of
        reasoning, ``</think>``), the output before it free.
        ``skip_special_tokens=False``: the text keeps special tokens (but the end-of-sequence or stop token
        that ends it). ``include_stop_str_in_output``: the text ends with the stop string that ended it.
        ``priority``: lower is admitted and given the step's budget first, and preempted last (ties: first
        come, first served). ``lora``: the name of the LoRA adapter the request runs with (None: the base
        model). ``cache_salt``: the request shares cached prefix blocks only with requests of the same salt."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already running")
        if lora is not None and self.lora is None:
            raise ValueError(f"request {request_id!r} names LoRA adapter {lora!r}, and this engine has no adapters")
        lora_slot = -1 if lora is None else self.lora.slot(lora)  # refuses unknown names
        (ids,) = encode_prompts(self.model, [prompt])
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= self.max_logprobs:
                raise ValueError(f"{name} must be in [0, {self.max_logprobs}], got {value}")
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        eos_ids = () if ignore_eos else tuple(self.model.eos_ids)
        stop_ids = tuple(int(t) for t in stop_token_ids) + tuple(self.model.stop_ids)
        end_ids = tuple(dict.fromkeys(eos_ids + stop_ids))
        if len(end_ids) > END_WIDTH:
            raise ValueError(f"at most {END_WIDTH} end-of-sequence and stop token ids, got {len(end_ids)}")
        V = self.config.vocab_size
        if bad := [t for t in (*end_ids, *sampling.token_ids()) if not 0 <= t < V]:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {V})")
        step_controls(Shape(T=1, B=1, X=1, Q=1, kind="sample"), [sampling], np.zeros((1, 0), np.int32),
                      np.zeros((1,), np.int32), bias_width=BIAS_WIDTH)  # refuses what the step cannot run
        matcher = None
        if guided_after_token is not None and (guided is None or not 0 <= guided_after_token < V):
            raise ValueError(f"guided_after_token must be a token id in [0, {V}) and go with guided, got "
                             f"{guided_after_token}")
        if guided is not None:
            if self.model.tokenizer is None:
                raise ValueError(f"guided decoding needs the model's tokenizer, and {self.model.path} has none")
            matcher = Matcher(vocabulary(self.model.tokenizer, tuple(self.model.eos_ids), V), guided)
        request = Request(request_id=request_id, prompt_token_ids=ids, max_new_tokens=max_new_tokens,
                          use_prefix_cache=prompt_logprobs is None, priority=int(priority),
                          hash_root=self._hash_root(lora, cache_salt))
        self.scheduler.add(request)  # refuses requests that can never fit
        self._live[request_id] = _Live(
            request=request, sampling=sampling, end_ids=end_ids, eos_ids=frozenset(eos_ids),
            stop_ids=frozenset(stop_ids), min_new_tokens=min_new_tokens, logprobs=logprobs, sample_index=sample_index,
            text=SequenceText(self.model.tokenizer, list(ids), tuple(stop), min_new_tokens,
                              skip_special=skip_special_tokens, end_ids=frozenset(end_ids),
                              include_stop=include_stop_str_in_output),
            prompt_logprobs=prompt_logprobs, matcher=matcher, guided_after=guided_after_token, lora=lora,
            lora_slot=lora_slot)

    def _hash_root(self, lora: str | None, cache_salt: str | None) -> bytes:
        """The prefix-cache namespace of a request: its adapter's (as loaded now), salted."""
        root = ROOT_HASH if lora is None else self.lora.hash_root(lora)
        return root if cache_salt is None else salted(root, cache_salt)

    # LoRA adapters.
    @property
    def lora_names(self) -> tuple[str, ...]:
        """The loaded LoRA adapters' names."""
        return () if self.lora is None else self.lora.names

    def lora_requests(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters the running requests use, and those the waiting ones do (each name once)."""
        def names(requests) -> tuple[str, ...]:
            lives = (self._live.get(r.request_id) for r in list(requests))
            return tuple(dict.fromkeys(live.lora for live in lives if live is not None and live.lora is not None))

        return names(self.scheduler.running), names(self.scheduler.waiting)

    def add_lora(self, adapter: AdapterArg, name: str | None = None) -> str:
        """Loads a LoRA adapter (a PEFT folder, named ``name`` or after the folder, or a ``LoraAdapter``)
        into a free slot, for requests to name from now on; returns its name. Compiles nothing."""
        if self.lora is None:
            raise ValueError("this engine was started without LoRA slots: give it max_loras")
        return self.lora.add(adapter, name).name

    def remove_lora(self, name: str) -> None:
        """Unloads LoRA adapter ``name``; refused while a request runs with it. Its cached blocks are left to
        eviction: nothing matches them any more (each load of an adapter has a prefix-cache namespace of its
        own, even under a reused name)."""
        if self.lora is None:
            raise ValueError(f"unknown LoRA adapter {name!r}: this engine has no adapters")
        if users := [rid for rid, live in self._live.items() if live.lora == name]:
            raise ValueError(f"LoRA adapter {name!r} is in use by requests {users[:5]}")
        self.lora.remove(name)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False when it is unknown or already finished."""
        self._live.pop(request_id, None)
        return self.scheduler.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # Steps.
    def shapes(self) -> list[Shape]:
        """Every step program this engine can run: decode-only steps by sequences, mixed steps by tokens
        (and steps scoring prompts, always mixed)."""
        kinds = [("greedy", 0)] * (not self.processors) + [("sample", 0), ("logprobs", self.max_logprobs)]
        decode = [(B, B, 1) for B in self.seq_buckets]
        mixed = [(T, self.max_num_seqs, T) for T in self.token_buckets]
        shapes = ([Shape(T=T, B=B, X=self.X, Q=Q, kind=kind, top_n=top_n)
                   for (kind, top_n), (T, B, Q) in itertools.product(kinds, decode + mixed)]
                  + [Shape(T=T, B=B, X=self.X, Q=Q, kind="prompt", top_n=self.max_logprobs) for T, B, Q in mixed])
        if self.speculative is None:
            return shapes
        # And the steps that verify proposals: decode steps by sequences (k + 1 tokens each), mixed by tokens;
        # with a draft, those of the kinds guided requests run in again, drafted first.
        K = self.speculative.num_tokens
        verifying = [dataclasses.replace(s, T=s.B * (K + 1) if s.Q == 1 else s.T, Q=K + 1 if s.Q == 1 else s.Q, K=K)
                     for s in shapes]
        drafted = [dataclasses.replace(s, drafted=True) for s in verifying if s.kind != "greedy"]
        return shapes + verifying + (drafted if self.draft is not None else [])

    def warm_up(self) -> int:
        """Compile every step program (:meth:`shapes`) by running it on padding; returns how many."""
        shapes = self.shapes()
        for shape in shapes:
            inputs = abstract_inputs(shape, self.config, bias_width=BIAS_WIDTH, end_width=END_WIDTH,
                                     max_model_len=self.max_model_len, draft=self.draft is not None,
                                     lora=self.lora is not None, processors=self.processors)
            self._run(self._draft_first(inputs) if shape.drafted else inputs)
        jax.block_until_ready((self.cache, self.draft_cache))
        return len(shapes)

    def _run(self, inputs: StepInputs):
        """One step on the caches, which it replaces: what the step emitted, and the prompt scores."""
        draft = {} if inputs.draft is None else dict(
            draft_weights=self.draft.weights, draft_cache=self.draft_cache, draft_config=self.draft.config,
            draft_backend=self.draft.backend)
        self.cache, emitted, scored, draft_cache = step(
            self.model.weights, self.config, self.cache, inputs, backend=self.model.backend, mesh=self.model.mesh,
            lora_weights=None if self.lora is None else self.lora.weights, **draft)
        if inputs.draft is not None:
            self.draft_cache = draft_cache
        return emitted, scored

    def _draft_first(self, inputs: StepInputs) -> StepInputs:
        """The draft's part of a step run first, on its own (:func:`llm_jax.serving.step.draft_step`): the
        step's inputs with its proposals in place of the placeholders, to verify without the draft."""
        # Without what the draft does not read, the steps of every kind but "greedy" share its program.
        for_draft = dataclasses.replace(inputs, controls=dataclasses.replace(inputs.controls, logprobs=None),
                                        tokens_BS=None, prompt_lens_B=None, lengths_B=None, prompt_targets_T=None,
                                        allowed_BJW=None, lora_slots_T=None)
        self.draft_cache, proposals_BK, q_BKV = draft_step(self.draft.weights, self.draft.config, self.draft_cache,
                                                           for_draft, backend=self.draft.backend)
        proposals_BK = np.asarray(jax.device_get(proposals_BK))
        tokens_T, batch = np.array(inputs.tokens_T), inputs.batch
        for b in np.flatnonzero(inputs.num_proposals_B):
            end = batch.query_start_B[b] + batch.num_tokens_B[b]
            tokens_T[end - inputs.num_proposals_B[b]:end] = proposals_BK[b, :inputs.num_proposals_B[b]]
        return dataclasses.replace(inputs, tokens_T=tokens_T, proposals_BK=proposals_BK, q_BKV=q_BKV, draft=None)

    def _shape(self, plan: StepPlan, kind: str, lives: list[_Live]) -> Shape:
        top_n = self.max_logprobs if kind in ("logprobs", "prompt") else 0
        K = self.speculative.num_tokens if plan.num_proposals_B.any() else 0
        # A draft's proposals that guided requests' masks follow: the host must see them first.
        drafted = self.draft is not None and any(
            n and live.matcher is not None for n, live in zip(plan.num_proposals_B, lives))
        T = next(t for t in self.token_buckets if t >= plan.num_tokens)
        if (plan.num_tokens_B - plan.num_proposals_B == 1).all() and kind != "prompt":
            B = next(b for b in self.seq_buckets if b >= plan.num_seqs)
            # Verifying, the mixed step of fewer tokens, where some sequences propose less than k.
            if not K or T >= B * (K + 1):
                return Shape(T=B * (K + 1), B=B, X=self.X, Q=K + 1, kind=kind, top_n=top_n, K=K, drafted=drafted)
        return Shape(T=T, B=self.max_num_seqs, X=self.X, Q=T, kind=kind, top_n=top_n, K=K, drafted=drafted)

    def _inputs(self, plan: StepPlan, shape: Shape, lives: list[_Live]) -> StepInputs:
        n, T, B = plan.num_seqs, plan.num_tokens, shape.B

        def padded(a: np.ndarray, size: int, fill=0) -> np.ndarray:
            out = np.full((size, *a.shape[1:]), fill, a.dtype)
            out[:len(a)] = a
            return out

        tables = np.full((B, self.X), NULL_BLOCK, np.int32)
        tables[:n, :plan.block_tables_BX.shape[1]] = plan.block_tables_BX
        query_start_B = padded(plan.query_start_B, B, T)  # padding sequences: no tokens, after the real ones
        batch = PagedBatch(slots_T=padded(plan.slots_T, shape.T, NULL_BLOCK), block_tables_BX=tables,
                           query_start_B=query_start_B, num_tokens_B=padded(plan.num_tokens_B, B),
                           seq_lens_B=padded(plan.seq_lens_B, B), max_query_len=shape.Q)
        sampling = [live.sampling for live in lives] + [GREEDY] * (B - n)
        end_ids_BE = np.full((B, END_WIDTH), PAD_ID, np.int32)
        for b, live in enumerate(lives):
            end_ids_BE[b, :len(live.end_ids)] = live.end_ids
        min_new_B = padded(np.array([live.min_new_tokens for live in lives], np.int32), B)
        controls = step_controls(shape, sampling, end_ids_BE, min_new_B, bias_width=BIAS_WIDTH,
                                 processors=self.processors)
        samples = np.array([live.sample_index for live in lives] + [0] * (B - n), np.int32)
        controls = dataclasses.replace(controls, sampling=dataclasses.replace(controls.sampling, sample_B=samples))
        generated_B = padded(np.array([live.request.num_output_tokens for live in lives], np.int32), B)
        extra = {}
        if shape.kind != "greedy":
            tokens_BS = np.zeros((B, self.max_model_len), np.int32)
            for b, live in enumerate(lives):
                tokens_BS[b, :live.request.num_tokens] = live.request.token_ids
            extra = dict(tokens_BS=tokens_BS,
                         prompt_lens_B=padded(np.array([len(l.request.prompt_token_ids) for l in lives], np.int32), B),
                         lengths_B=padded(np.array([l.request.num_tokens for l in lives], np.int32), B))
        if shape.kind == "prompt":  # the prompt token after each token, where a scored prompt has one
            targets_T = np.full((shape.T,), -1, np.int32)
            for b, live in enumerate(lives):
                if live.scores_prompt:
                    prompt = np.asarray(live.request.prompt_token_ids, np.int32)
                    span = slice(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b])
                    next_S = plan.positions_T[span] + 1
                    targets_T[span] = np.where(next_S < len(prompt), prompt[np.minimum(next_S, len(prompt) - 1)], -1)
            extra["prompt_targets_T"] = targets_T
        if shape.K:  # each sequence's proposals: its last tokens
            proposals_BK = np.zeros((B, shape.K), np.int32)
            for b in np.flatnonzero(plan.num_proposals_B):
                end = plan.query_start_B[b] + plan.num_tokens_B[b]
                proposals_BK[b, :plan.num_proposals_B[b]] = plan.token_ids_T[end - plan.num_proposals_B[b]:end]
            extra.update(proposals_BK=proposals_BK, num_proposals_B=padded(plan.num_proposals_B, B))
        if shape.kind != "greedy":  # what each sequence may choose (a draft's proposals' masks come after it)
            allowed_BJW = (all_allowed(B * (shape.K + 1), self.config.vocab_size).reshape(B, shape.K + 1, -1)
                           if shape.drafted else self._allowed(plan, shape, lives, extra.get("proposals_BK")))
            if shape.K:
                extra["allowed_BJW"] = allowed_BJW
            else:
                controls = dataclasses.replace(controls, allowed_BW=allowed_BJW[:, 0])
        if self.draft is not None:
            extra["draft"] = self._draft_inputs(plan, shape, tables)
        if self.lora is not None:  # each token's adapter slot
            slots_T = np.full((shape.T,), -1, np.int32)
            for b, live in enumerate(lives):
                slots_T[plan.query_start_B[b]:plan.query_start_B[b] + plan.num_tokens_B[b]] = live.lora_slot
            extra["lora_slots_T"] = slots_T
        return StepInputs(tokens_T=padded(plan.token_ids_T, shape.T), positions_T=padded(plan.positions_T, shape.T),
                          batch=batch, controls=controls, num_generated_B=generated_B, **extra)

    def _allowed(self, plan: StepPlan, shape: Shape, lives: list[_Live], proposals_BK: np.ndarray | None
                 ) -> np.ndarray:
        """What each sequence may choose at each position it verifies [B, K + 1, words] (guided ones: what
        their constraint allows after their proposals before it), all ones for the others."""
        J = shape.K + 1
        allowed_BJW = all_allowed(shape.B * J, self.config.vocab_size).reshape(shape.B, J, -1)
        for b, live in enumerate(lives):
            if live.matcher is not None and plan.samples_B[b]:
                n = int(plan.num_proposals_B[b])
                live.fill_masks(allowed_BJW[b, :n + 1], [] if not n else proposals_BK[b, :n].tolist())
        return allowed_BJW

    def _draft_inputs(self, plan: StepPlan, shape: Shape, tables_BX: np.ndarray) -> Draft:
        """The draft's first pass: each sequence's known tokens of the step (not its proposals), after the
        token before them where it has proposals; padded as the step."""
        n, B, Z = plan.num_seqs, shape.B, self.block_size
        again_B = (plan.num_proposals_B > 0).astype(np.int32)  # the token before the latest, fed again
        known_B = plan.num_tokens_B - plan.num_proposals_B
        num_B = known_B + again_B
        start_B = (np.cumsum(num_B) - num_B).astype(np.int32)
        first_B = plan.seq_lens_B - plan.num_tokens_B - again_B  # the position each one's tokens start at
        seq_B = np.repeat(np.arange(n), num_B)
        positions_T = (np.arange(len(seq_B)) - start_B[seq_B] + first_B[seq_B]).astype(np.int32)
        tokens_T = np.empty_like(positions_T)
        for b, request_id in enumerate(plan.request_ids):
            tokens = self.scheduler.get(request_id).token_ids
            tokens_T[start_B[b]:start_B[b] + num_B[b]] = tokens[first_B[b]:first_B[b] + num_B[b]]
        slots_T = tables_BX[seq_B, positions_T // Z] * Z + positions_T % Z

        def padded(a, size, fill=0):
            out = np.full((size,), fill, np.int32)
            out[:len(a)] = a
            return out

        batch = PagedBatch(slots_T=padded(slots_T, shape.T, NULL_BLOCK), block_tables_BX=tables_BX,
                           query_start_B=padded(start_B, B, len(seq_B)), num_tokens_B=padded(num_B, B),
                           seq_lens_B=padded(first_B + num_B, B), max_query_len=shape.Q)
        return Draft(tokens_T=padded(tokens_T, shape.T), positions_T=padded(positions_T, shape.T), batch=batch)

    def _fail(self, plan: StepPlan) -> None:
        """After a step failed: its requests end; if the cache went with it (donated to the failed
        program), every running request ends too and the prefix cache is emptied."""
        for request_id in plan.request_ids:
            self.abort(request_id)
        self.scheduler.update(plan, np.zeros((plan.num_seqs,), np.int32))
        if any(leaf.is_deleted() for leaf in jax.tree.leaves((self.cache, self.draft_cache))):
            for request in self.scheduler.running:
                self.abort(request.request_id)
            self.scheduler.pool.forget_cached()
            if self.draft_cache is not None:
                self.draft_cache = self._new_cache(self.cache.num_pages, draft=True)
            self.cache = self._new_cache(self.cache.num_pages)

    @staticmethod
    def _keep_prompt_scores(plan: StepPlan, lives: list[_Live], scored) -> None:
        """Each scored prompt's log-probabilities from this step, by the position of the token they score."""
        for b, live in enumerate(lives):
            if not live.scores_prompt:
                continue
            n = live.prompt_logprobs
            for t in range(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b]):
                position = int(plan.positions_T[t]) + 1
                if position < len(live.request.prompt_token_ids):
                    top = ({} if not n else {int(i): float(p) for i, p in
                                             zip(scored.top_ids_BTN[0, t, :n], scored.top_logprobs_BTN[0, t, :n])})
                    live.prompt_scores[position] = (float(scored.logprobs_BT[0, t]), int(scored.ranks_BT[0, t]), top)

    @staticmethod
    def _prompt_scores(live: _Live) -> dict:
        """A prompt's log-probabilities, as :class:`RequestOutput` gives them."""
        scores = [live.prompt_scores[p] for p in range(1, len(live.request.prompt_token_ids))]
        return dict(prompt_logprobs=(None, *(lp for lp, _, _ in scores)),
                    prompt_ranks=(None, *(rank for _, rank, _ in scores)),
                    prompt_top_logprobs=(None, *(top for _, _, top in scores)))

    def _propose(self) -> None:
        """Proposals for each decoding request's next tokens (speculative decoding), as many as its length
        limit leaves room for, unless it scores its prompt or is backing off after failures, or more than
        ``Speculative.max_batch`` requests run. A guided request's n-gram proposals end before the first its
        constraint forbids (verified, it would be rejected)."""
        k, speculative = self.speculative.num_tokens, self.speculative
        if speculative.max_batch is not None and self.scheduler.num_running > speculative.max_batch:
            return
        for request in self.scheduler.running:
            live = self._live[request.request_id]
            if request.num_computed_tokens != request.num_tokens - 1 or live.scores_prompt:
                continue
            if not live.backoff.speculate:
                live.backoff = live.backoff.after_plain()
                continue
            room = min(request.max_new_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            if room > 0 and self.draft is not None:
                request.spec_token_ids = [0] * min(k, room)  # placeholders: the step draws them from the draft
            elif room > 0:
                proposals = ngram_proposals(
                    np.asarray(request.token_ids), k=min(k, room), lookup_min=speculative.prompt_lookup_min,
                    lookup_max=speculative.prompt_lookup_max).tolist()
                if live.matcher is not None:
                    proposals = proposals[:live.guided_prefix(proposals)]
                request.spec_token_ids = proposals

    def _end(self, live: _Live, tokens: list[int]) -> tuple[list[int], FinishReason | None, int | None, bool]:
        """A sequence's new tokens up to the first that ends it — an end id, the length limit, or its
        constraint complete (its matcher consumes them one by one) — the reason, the stop id, and whether
        it reached the length limit."""
        request = live.request
        for i, token in enumerate(tokens):
            reason = stop_reason = None
            if token in live.eos_ids:
                reason = FinishReason.EOS
            elif token in live.stop_ids:
                reason, stop_reason = FinishReason.STOP, token
            length = (request.num_output_tokens + i + 1 >= request.max_new_tokens
                      or request.num_tokens + i + 1 >= self.max_model_len)
            if live.matcher is not None and reason is None and not length:
                if live.guided_after is not None:  # free until its token, constrained after it
                    if token == live.guided_after:
                        live.guided_after = None
                # Its constraint complete (or, which the masks rule out, broken): nothing may follow.
                elif not live.matcher.consume([token]) or live.matcher.done:
                    reason = FinishReason.STOP
            if reason is not None or length:
                return tokens[:i + 1], reason, stop_reason, length
        return tokens, None, None, False

    def step(self) -> list[RequestOutput]:
        """Run one step: each request that produced something gets a :class:`RequestOutput`."""
        if self.speculative is not None:
            self._propose()
        plan = self.scheduler.schedule()
        if plan.num_seqs == 0:
            return []
        lives = [self._live[rid] for rid in plan.request_ids]
        kinds = {live.kind for live in lives}
        kind = next(k for k in ("prompt", "logprobs", "sample", "greedy") if k in kinds or k == "greedy")
        kind = "sample" if kind == "greedy" and self.processors else kind  # the processors run in every step
        shape = self._shape(plan, kind, lives)
        try:
            inputs = self._inputs(plan, shape, lives)
            if shape.drafted:  # the draft's proposals, then their masks
                inputs = self._draft_first(inputs)
                inputs = dataclasses.replace(inputs, allowed_BJW=self._allowed(plan, shape, lives, inputs.proposals_BK))
            emitted, scored = self._run(inputs)
            emitted, scored = jax.device_get((emitted, scored))
        except Exception as error:
            self._fail(plan)
            raise StepError(plan.request_ids, error) from error
        # Each sequence's new tokens [B, J]: one, or the accepted proposals and the model's own token.
        def by_sequence(a, *tail):
            return None if a is None else np.asarray(a).reshape(len(emitted.tokens_BS), -1, *tail)

        tokens_BJ = by_sequence(emitted.tokens_BS)
        logprobs_BJ = by_sequence(emitted.logprobs_BS)
        top_ids_BJN = by_sequence(emitted.top_ids_BSN, self.max_logprobs)
        top_logprobs_BJN = by_sequence(emitted.top_logprobs_BSN, self.max_logprobs)
        if scored is not None:
            self._keep_prompt_scores(plan, lives, scored)
        outputs, stopped, new_tokens, accepted_B = [], {}, [[] for _ in lives], np.zeros((len(lives),), np.int32)
        for b, live in enumerate(lives):
            if not plan.samples_B[b]:
                continue
            prompt_scores = {}
            if live.scores_prompt:  # its prompt is done: its scores go out with its first token
                prompt_scores = self._prompt_scores(live)
                live.request.use_prefix_cache = True  # recomputed after a preemption, it may start from the cache
            request = live.request
            tokens = [int(t) for t in tokens_BJ[b] if t != PAD_ID]
            accepted_B[b] = len(tokens) - 1
            if plan.num_proposals_B[b]:
                live.backoff = live.backoff.after_speculation(accepted_B[b], 1, self.speculative)
            tokens, reason, stop_reason, length = self._end(live, tokens)
            kept, text, hit_stop = live.text.push(tokens, last=reason is not None or length)
            if hit_stop:
                reason, stop_reason = FinishReason.STOP, live.text.matcher.stop
            if reason is not None:
                stopped[request.request_id] = reason
            new_tokens[b] = kept
            logprobs = top = None
            if live.logprobs is not None:
                n, j = live.logprobs, range(len(kept))
                logprobs = tuple(float(logprobs_BJ[b, i]) for i in j)
                top = tuple({} if not n else {int(t): float(p) for t, p in zip(top_ids_BJN[b, i, :n],
                                                                                top_logprobs_BJN[b, i, :n])}
                            for i in j)
            outputs.append(RequestOutput(
                request_id=request.request_id, token_ids=tuple(kept), text=text, stop_reason=stop_reason,
                logprobs=logprobs, top_logprobs=top, num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=request.num_output_tokens + len(kept), **prompt_scores))
        finished = {r.request_id: r for r in self.scheduler.update(plan, new_tokens, stopped, accepted_B=accepted_B)}
        result = []
        for out in outputs:
            request = finished.get(out.request_id)
            if request is not None:
                self._live.pop(out.request_id, None)
                out = dataclasses.replace(out, finish_reason=request.finish_reason.value)
            result.append(out)
        return result
