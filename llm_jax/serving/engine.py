"""The serving engine: requests arrive at any time and run together, step by step, over a paged KV cache.

    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=256)
    engine.add_request("a", "Once upon a time", max_new_tokens=64)
    while engine.has_unfinished:
        for out in engine.step():       # each request's new tokens and text, and its finish reason
            ...

Each step the scheduler (host, :mod:`llm_jax.serving.scheduler`) plans which tokens run — one for every
decoding sequence, chunks of prompts while the token budget lasts —, the builder
(:mod:`llm_jax.serving.batching`) pads the plan to one of a few shapes, compiled once by
:meth:`Engine.warm_up`, and the device step (:mod:`llm_jax.serving.step`) runs them and picks each
sequence's next token with the same processors and sampling as ``generate``. Each request's end-of-sequence
ids, stop ids and stop strings are checked on the host (:mod:`llm_jax.serving.live`), as ``generate``
checks its text.

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
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from llm_jax.decoding import PAD_ID, check_processors
from llm_jax.generation import Prompt, encode_prompts
from llm_jax.guided import Guided, Matcher, vocabulary
from llm_jax.kv_cache import cache_bytes_per_token, cache_dtype, init_paged_cache
from llm_jax.loading import Model
from llm_jax.sampling import GREEDY, Sampling
from llm_jax.serving.adapters import AdapterArg, LoraSlots
from llm_jax.serving.batching import BIAS_WIDTH, END_WIDTH, StepBuilder
from llm_jax.serving.blocks import ROOT_HASH, salted
from llm_jax.serving.live import LiveRequest, RequestOutput
from llm_jax.serving.scheduler import Request, Scheduler, SchedulerStats, StepPlan
from llm_jax.serving.step import Shape, StepInputs, draft_step, step, step_controls
from llm_jax.sharding import paged_cache_shardings
from llm_jax.speculative import Method, Speculative, ngram_proposals
from llm_jax.stop_strings import SequenceText

__all__ = ["BIAS_WIDTH", "END_WIDTH", "Engine", "RequestOutput", "StepError"]


class StepError(RuntimeError):
    """A step failed; the requests it ran (``request_ids``) were ended, the others go on."""

    def __init__(self, request_ids: Sequence[str], error: BaseException):
        super().__init__(f"a step of requests {list(request_ids)} failed: {error}")
        self.request_ids = tuple(request_ids)


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
        self.builder = StepBuilder(
            config=config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=block_size, max_logprobs=max_logprobs,
            num_speculative=0 if speculative is None else speculative.num_tokens, draft=self.draft is not None,
            lora=self.lora is not None, processors=self.processors)
        self.X = self.builder.X
        self._live: dict[str, LiveRequest] = {}

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
                    cache_salt: str | None = None, processor_args: dict[str, float] | None = None) -> None:
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
        model). ``cache_salt``: the request shares cached prefix blocks only with requests of the same salt.
        ``processor_args``: values of the arguments the engine's logits processors read
        (:class:`llm_jax.decoding.LogitsProcessor`; the others keep their defaults)."""
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
                      np.zeros((1,), np.int32), bias_width=BIAS_WIDTH, processors=self.processors,
                      processor_args=[processor_args])  # refuses what the step cannot run
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
        self._live[request_id] = LiveRequest(
            request=request, sampling=sampling, end_ids=end_ids, eos_ids=frozenset(eos_ids),
            stop_ids=frozenset(stop_ids), min_new_tokens=min_new_tokens, logprobs=logprobs, sample_index=sample_index,
            text=SequenceText(self.model.tokenizer, list(ids), tuple(stop), min_new_tokens,
                              skip_special=skip_special_tokens, end_ids=frozenset(end_ids),
                              include_stop=include_stop_str_in_output),
            prompt_logprobs=prompt_logprobs, matcher=matcher, guided_after=guided_after_token, lora=lora,
            lora_slot=lora_slot, processor_args=processor_args)

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
        """Every step program this engine can run (:meth:`StepBuilder.shapes`)."""
        return self.builder.shapes()

    def warm_up(self) -> int:
        """Compile every step program (:meth:`shapes`) by running it on padding; returns how many."""
        shapes = self.shapes()
        for shape in shapes:
            inputs = self.builder.abstract(shape)
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

    def step(self) -> list[RequestOutput]:
        """Run one step: each request that produced something gets a :class:`RequestOutput`."""
        if self.speculative is not None:
            self._propose()
        plan = self.scheduler.schedule()
        if plan.num_seqs == 0:
            return []
        lives = [self._live[rid] for rid in plan.request_ids]
        shape = self.builder.shape(plan, lives)
        try:
            inputs = self.builder.inputs(plan, shape, lives)
            if shape.drafted:  # the draft's proposals, then their masks
                inputs = self._draft_first(inputs)
                inputs = dataclasses.replace(inputs, allowed_BJW=self.builder.allowed(plan, shape, lives,
                                                                                      inputs.proposals_BK))
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
        if scored is not None:  # each scored prompt's log-probabilities of the step
            for b, live in enumerate(lives):
                if live.scores_prompt:
                    span = slice(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b])
                    live.keep_prompt_scores(plan.positions_T[span], scored.logprobs_BT[0, span],
                                            scored.ranks_BT[0, span], scored.top_ids_BTN[0, span],
                                            scored.top_logprobs_BTN[0, span])
        outputs, stopped, new_tokens, accepted_B = [], {}, [[] for _ in lives], np.zeros((len(lives),), np.int32)
        for b, live in enumerate(lives):
            if not plan.samples_B[b]:
                continue
            tokens = [int(t) for t in tokens_BJ[b] if t != PAD_ID]
            accepted_B[b] = len(tokens) - 1
            if plan.num_proposals_B[b]:
                live.backoff = live.backoff.after_speculation(accepted_B[b], 1, self.speculative)
            rows = [None if a is None else a[b] for a in (logprobs_BJ, top_ids_BJN, top_logprobs_BJN)]
            out, reason = live.output(tokens, *rows, max_model_len=self.max_model_len)
            if reason is not None:
                stopped[out.request_id] = reason
            new_tokens[b] = list(out.token_ids)
            outputs.append(out)
        finished = {r.request_id: r for r in self.scheduler.update(plan, new_tokens, stopped, accepted_B=accepted_B)}
        result = []
        for out in outputs:
            request = finished.get(out.request_id)
            if request is not None:
                self._live.pop(out.request_id, None)
                out = dataclasses.replace(out, finish_reason=request.finish_reason.value)
            result.append(out)
        return result
