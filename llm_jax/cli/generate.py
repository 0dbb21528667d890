"""``scripts/generate.py``: generate text from a model on the command line, streaming as it goes.

Arguments are parsed and checked, the prompt read and the chat template found before JAX starts, so
``--help`` and most mistakes answer at once. Flags come in groups (``_add_*_flags``); a new flag goes in
its group, and into :func:`generation_options` when ``generate_stream`` takes it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from llm_jax.cli.chat import run_chat
from llm_jax.cli.common import (CliError, CliParser, finite_float, non_negative_float, non_negative_int, one_line,
                                open_probability, positive_float, positive_int, probability, run_main, token_ids,
                                uint32)
from llm_jax.cli.output import json_report, metrics_fields, print_status, prompt_echo, write_stream

if TYPE_CHECKING:
    from llm_jax.loading import Model

STDIN = "-"
# The story model trained by scripts/train_tiny.py, shipped in the repository's checkpoints/ folder; found
# relative to this file, so it works from any current directory of a source checkout or editable install.
DEFAULT_MODEL = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "stories-1m"

DESCRIPTION = "Generate text with llm_jax, streaming it to stdout as it is generated."
EPILOG = """\
what it prints:
  The prompt and its continuation stream to stdout as decode steps complete. A batch (several
  --prompt / --prompt-ids) prints each prompt's output under a '--- i/n ---' line, in prompt order:
  the first unfinished one streams live, the others appear once those before them are done. A model
  without a tokenizer prints the generated token ids. Unless --quiet, a metrics line follows on
  stderr: generated tokens, time to first token, inter-token latency p50/p90, decode tokens/s,
  compile time. --json prints one JSON object at the end instead:
    {"model", "results": [{"prompt", "prompt_ids", "output_ids", "text", "finish_reason"}],
     "metrics": {"compile_s", "ttft_s", "itl_s", "decode_tokens_per_s"}}
  ("prompt" is null for --prompt-ids, "text" for a model without a tokenizer; "prompt_ids" include
  BOS when the model adds one, "output_ids" are the generated ids only; "finish_reason" is "eos",
  "length" or "stop").

chat:
  --chat reads user messages from stdin, one per line (a terminal gets a '> ' prompt), renders the
  conversation through the model's chat template each turn and streams the reply. After each reply
  stderr shows '[context USED/SIZE tokens · metrics]'. Commands: /reset, /exit (or Ctrl-D), /help.

speed:
  Compiled programs are kept in ~/.cache/llm_jax/xla (LLM_JAX_COMPILATION_CACHE=DIR: elsewhere; =off: not
  kept). A second run of the same model and prompt bucket loads prefill, start and decode whole, without
  tracing, lowering or compiling them.

errors:
  One line 'error: ...' on stderr; exit status 1 (2 for a misused flag, 130 on Ctrl-C).

examples:
  generate.py --prompt "Once upon a time"      # the story model shipped in checkpoints/
  generate.py --model stories260K.bin --prompt "Once upon a time" --max-new-tokens 100
  echo "Once upon a time" | generate.py --model stories260K.bin --prompt - --json
  generate.py --model path/to/chat-model --chat --system "You are terse."
  generate.py --model path/to/big-model --dtype bfloat16 --mesh model=8 --prompt "Hi"     # 8 GPUs
  generate.py --model stories110M.bin --speculative ngram --num-speculative-tokens 6 --prompt "..."
"""


def build_parser() -> CliParser:
    parser = CliParser(description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(parser.add_argument_group("model"))
    _add_prompt_flags(parser.add_argument_group("prompts"))
    _add_generation_flags(parser.add_argument_group("generation"))
    _add_sampling_flags(parser.add_argument_group("sampling (default: greedy)"))
    _add_processor_flags(parser.add_argument_group("logits processors (greedy and sampled)"))
    _add_search_flags(parser.add_argument_group("several completions"))
    _add_guided_flags(parser.add_argument_group(
        "structured output (the completion follows one constraint and ends with it; docs/serving.md)"))
    _add_speculative_flags(parser.add_argument_group(
        "speculative decoding (same output: greedy ids, or the sampled distribution; docs/speculative_decoding.md)"))
    _add_output_flags(parser.add_argument_group("output"))
    _add_device_flags(parser.add_argument_group(
        "many devices and hosts (docs/running_on_many_devices.md; on several hosts run the same command on each)"))
    return parser


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                       help="llama2.c .bin file, Hugging Face model folder, or llm_jax checkpoint folder "
                            "(default: the story model shipped in checkpoints/)")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="parameter and compute dtype (default: the checkpoint's)")
    group.add_argument("--backend", choices=["auto", "xla", "cpu", "pallas"], default="auto",
                       help="how the model runs: the CPU kernels on one CPU device, Pallas attention kernels on "
                            "GPU/TPU, or XLA's own operations (default: %(default)s, which picks by platform)")
    group.add_argument("--lora", metavar="PATH",
                       help="a PEFT LoRA adapter folder, merged into the weights (before --quantize)")
    add_quantize_flags(group)


def add_quantize_flags(group: argparse._ArgumentGroup) -> None:
    """``--quantize`` and ``--group-size`` (the server takes them too); :func:`quantization` reads them."""
    group.add_argument("--quantize", choices=["int8", "int4", "int4-asym"], default=None,
                       help="quantize the weights on load: int8 per output channel, int4 in groups (see --group-size; "
                            "int4-asym: with an offset per group)")
    group.add_argument("--group-size", type=positive_int, default=None, metavar="G",
                       help="inputs sharing one scale with --quantize (default: int8 per channel, int4 32)")


def _add_prompt_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                       help="a prompt; repeat for a batch; '-' reads it from stdin")
    group.add_argument("--prompt-ids", dest="prompts", action="append", type=token_ids, metavar="IDS",
                       help="a prompt as comma-separated token ids (1,15043,29892), used exactly as given: no "
                            "BOS is added; works for models without a tokenizer; repeat for a batch")
    group.add_argument("--chat", action="store_true",
                       help="converse through the model's chat template, reading user messages from stdin "
                            "(a --prompt is sent as the first message)")
    group.add_argument("--system", metavar="TEXT", help="the system message of a --chat conversation")


def _add_guided_flags(group: argparse._ArgumentGroup) -> None:
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument("--json-schema", metavar="FILE|JSON",
                           help="a JSON value matching this JSON Schema (a file, or the schema itself); '{}' or "
                                "'{\"type\": \"object\"}' for any JSON object")
    exclusive.add_argument("--regex", metavar="PATTERN", help="text matching this regular expression whole")
    exclusive.add_argument("--choice", action="append", metavar="TEXT", help="one of these texts; repeat for each")
    exclusive.add_argument("--grammar", metavar="FILE", help="text in this grammar's language (Lark, or GBNF)")


def guided_option(args: argparse.Namespace):
    """The constraint the structured-output flags give (``llm_jax.guided``), or None."""
    from llm_jax.guided import Choice, Grammar, Json, Regex

    if args.json_schema is not None:
        path = pathlib.Path(args.json_schema)
        text = path.read_text() if not args.json_schema.lstrip().startswith("{") and path.exists() else args.json_schema
        try:
            return Json(json.loads(text))
        except ValueError as error:
            raise CliError(f"--json-schema is not valid JSON: {error}") from None
    if args.regex is not None:
        return Regex(args.regex)
    if args.choice:
        return Choice(tuple(args.choice))
    if args.grammar is not None:
        try:
            return Grammar(pathlib.Path(args.grammar).read_text())
        except OSError as error:
            raise CliError(f"--grammar {args.grammar}: {error.strerror}") from None
    return None


def _add_generation_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N",
                       help="generate at most N tokens per prompt (per reply with --chat; default: %(default)s)")
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end tokens")
    group.add_argument("--stop", action="append", default=[], metavar="STRING",
                       help="end generation where this text appears, cutting it from the output; repeatable. "
                            "Taken literally: in bash, $'\\n' is a newline")
    group.add_argument("--stop-token-ids", type=token_ids, default=[], metavar="IDS",
                       help="comma-separated token ids that end generation (kept in the output)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "int8", "bfloat16", "float32"], default="auto",
                       help="what the KV cache holds: int8 with a scale per token and head (about half of "
                            "bfloat16's bytes), or a float dtype (default: the compute dtype)")
    group.add_argument("--min-new-tokens", type=non_negative_int, default=0, metavar="N",
                       help="end tokens and stop strings end nothing before N tokens (default: 0)")


def _add_sampling_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                       help="0 = greedy (default)")
    group.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                       help="sample among the K most likely tokens (0 = all)")
    group.add_argument("--top-p", type=open_probability, default=1.0, metavar="P",
                       help="sample among the most likely tokens holding probability mass P (1 = all)")
    group.add_argument("--min-p", type=probability, default=0.0, metavar="P",
                       help="drop tokens less likely than P times the most likely one (0 = none)")
    group.add_argument("--typical-p", type=open_probability, default=1.0, metavar="P",
                       help="locally typical sampling: keep the most typical tokens holding mass P (1 = all)")
    group.add_argument("--seed", type=uint32, default=0, help="random seed of sampling (default: %(default)s)")


def logit_bias(text: str) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"50256": -100}`` (JSON) or ``50256:-100,13:2``."""
    try:
        pairs = json.loads(text).items() if text.lstrip().startswith("{") else (
            part.split(":") for part in text.split(",") if part.strip())
        return {int(k): float(v) for k, v in pairs}
    except (ValueError, TypeError, AttributeError):
        raise argparse.ArgumentTypeError(f"expected token:bias pairs (13:2.5,50256:-100) or a JSON object, "
                                         f"got {text!r}") from None


def early_stopping(text: str) -> bool | str:
    """``transformers``' ``early_stopping``: true, false or never."""
    choices = {"true": True, "false": False, "never": "never"}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true, false or never, got {text!r}")
    return choices[text.lower()]


def _add_processor_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                       metavar="X", help="transformers': divide scores of prompt and output tokens by X (1 = off)")
    group.add_argument("--presence-penalty", type=finite_float, default=0.0, metavar="X",
                       help="OpenAI's: subtract X from scores of tokens the output contains")
    group.add_argument("--frequency-penalty", type=finite_float, default=0.0, metavar="X",
                       help="OpenAI's: subtract X times the count of each token in the output")
    group.add_argument("--logit-bias", type=logit_bias, default={}, metavar="ID:BIAS,...",
                       help="add BIAS to token ID's score (or a JSON object, as OpenAI's logit_bias)")
    group.add_argument("--suppress-tokens", type=token_ids, default=[], metavar="IDS",
                       help="comma-separated token ids never to generate")
    group.add_argument("--bad-words-ids", action="append", type=token_ids, default=[], metavar="IDS",
                       help="a token sequence never to generate, comma-separated; repeatable")
    group.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=0, metavar="N",
                       help="never repeat an N-gram of the prompt and output (0 = off)")


def _add_search_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--n", type=positive_int, default=1, help="samples per prompt, sharing one prefill")
    group.add_argument("--num-beams", type=positive_int, default=1, help="beam search when > 1 (greedy only)")
    group.add_argument("--length-penalty", type=finite_float, default=1.0, metavar="X",
                       help="beam search: a finished hypothesis scores log-probability / length**X")
    group.add_argument("--early-stopping", type=early_stopping, default=False, metavar="WHEN",
                       help="beam search: true, false (default) or never, as transformers")
    group.add_argument("--num-return-sequences", type=positive_int, default=1, metavar="N",
                       help="beam search: return the N best hypotheses")


def _add_speculative_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative", metavar="ngram|PATH",
                       help="propose tokens by prompt lookup ('ngram') or with the draft model at PATH (same "
                            "tokenizer), and verify them with one pass of the model per step")
    group.add_argument("--num-speculative-tokens", type=positive_int, default=4, metavar="K",
                       help="tokens proposed per step (default: %(default)s)")
    group.add_argument("--prompt-lookup-min", type=positive_int, default=2, metavar="N",
                       help="ngram: the shortest suffix looked up (default: %(default)s)")
    group.add_argument("--prompt-lookup-max", type=positive_int, default=4, metavar="N",
                       help="ngram: the longest suffix looked up (default: %(default)s)")


def _add_output_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    group.add_argument("--logprobs", type=non_negative_int, default=None, metavar="N",
                       help="with --json: each output token's log-probability and the N most likely tokens'")
    group.add_argument("--raw-logprobs", action="store_true",
                       help="--logprobs from the model's own distribution, before processors and filters")
    group.add_argument("--prompt-logprobs", type=non_negative_int, default=None, metavar="N",
                       help="with --json: each prompt token's log-probability and the N most likely tokens'")
    group.add_argument("--quiet", action="store_true",
                       help="no metrics line on stderr (--json has the metrics in its object)")


def _add_device_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--mesh", metavar="SPEC",
                       help="shard the model over devices: 'model=8', 'data=2,model=4', ... (default: one device; "
                            "with several processes, model over each host's devices and data across hosts)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0 of a multi-process run (default: $JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=non_negative_int, metavar="I", help="this process, 0 to N-1")
    group.add_argument("--distributed", action="store_true",
                       help="join the multi-process run the cluster describes (Slurm, Open MPI, Kubernetes, Cloud TPU)")


def check_flags(parser: CliParser, args: argparse.Namespace) -> None:
    """Combinations argparse cannot express; usage errors (exit 2) before anything is loaded."""
    id_prompts = [p for p in args.prompts if not isinstance(p, str)]
    if args.prompts.count(STDIN) > 1:
        parser.error(f"--prompt {STDIN} reads stdin, which can be read once")
    if (args.logprobs is not None or args.prompt_logprobs is not None) and not args.json:
        parser.error("--logprobs and --prompt-logprobs are reported in the --json object: add --json")
    if args.group_size is not None and args.quantize is None:
        parser.error("--group-size needs --quantize")
    if args.lora is not None and not (pathlib.Path(args.lora) / "adapter_config.json").is_file():
        parser.error(f"--lora {args.lora}: not a PEFT adapter folder (no adapter_config.json)")
    guided = args.json_schema is not None or args.regex is not None or args.choice or args.grammar is not None
    if guided and (args.num_beams > 1 or args.speculative is not None):
        parser.error("--json-schema, --regex, --choice and --grammar cannot be combined with --num-beams or "
                     "--speculative")
    if args.speculative is not None:
        unsupported = [flag for flag, used in (("--num-beams", args.num_beams > 1),) if used]
        if unsupported:
            parser.error(f"--speculative cannot be combined with {', '.join(unsupported)}")
        if args.prompt_lookup_min > args.prompt_lookup_max:
            parser.error(f"--prompt-lookup-min {args.prompt_lookup_min} exceeds --prompt-lookup-max "
                         f"{args.prompt_lookup_max}")
        if args.speculative != "ngram" and not pathlib.Path(args.speculative).exists():
            parser.error(f"--speculative takes 'ngram' or a draft model's path; {args.speculative} does not exist")
    if args.chat:
        if args.json:
            parser.error("--json and --chat exclude each other")
        if args.n > 1 or args.num_beams > 1:
            parser.error("--chat writes one reply per turn: --n and --num-beams cannot be used with it")
        if id_prompts:
            parser.error("--chat takes messages as text: use --prompt, not --prompt-ids")
        if STDIN in args.prompts:
            parser.error(f"--chat reads the conversation from stdin: --prompt {STDIN} cannot be used with it")
    else:
        if args.system is not None:
            parser.error("--system needs --chat")
        if not args.prompts:
            parser.error("give a --prompt or --prompt-ids (or --chat)")
    if args.chat and _distributed(args):
        parser.error("--chat runs in one process: it cannot be combined with several processes")


def _distributed(args: argparse.Namespace) -> bool:
    from llm_jax import distributed

    return args.distributed or distributed.requested(args.coordinator, args.num_processes, args.process_id)


def read_prompts(prompts: list[str | list[int]]) -> list[str | list[int]]:
    """Replace ``-`` by stdin (without the final newline ``echo`` adds)."""
    if STDIN not in prompts:
        return prompts
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    return [text if p == STDIN else p for p in prompts]


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``generate_stream`` the flags set."""
    from llm_jax.sampling import Sampling

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        typical_p=args.typical_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        logit_bias=args.logit_bias, suppress_tokens=args.suppress_tokens,
                        bad_words_ids=args.bad_words_ids, no_repeat_ngram_size=args.no_repeat_ngram_size)
    return dict(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop, ignore_eos=args.ignore_eos,
                stop_token_ids=args.stop_token_ids, min_new_tokens=args.min_new_tokens, n=args.n,
                num_beams=args.num_beams, length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                num_return_sequences=args.num_return_sequences, logprobs=args.logprobs,
                raw_logprobs=args.raw_logprobs, prompt_logprobs=args.prompt_logprobs,
                kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                guided=guided_option(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_flags(parser, args)
    if args.model == str(DEFAULT_MODEL) and not DEFAULT_MODEL.exists():
        raise CliError(f"the default model {DEFAULT_MODEL} is missing: it ships with the llm_jax repository "
                       "(a non-editable install has no checkpoints/ folder); pass --model")
    if not pathlib.Path(args.model).exists():
        raise CliError(f"model path {args.model} does not exist")
    template = _chat_template(args.model) if args.chat else None
    prompts = read_prompts(args.prompts)

    import jax

    from llm_jax import distributed
    from llm_jax.compilation import enable_persistent_cache
    from llm_jax.loading import load
    from llm_jax.sharding import make_mesh

    enable_persistent_cache()  # a second run of the same model and prompt bucket loads its programs whole
    if _distributed(args):
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        except distributed.DistributedError as e:
            raise CliError(str(e)) from None
    # Every process runs the same program; several processes always shard over all their devices.
    mesh = args.mesh if args.mesh is not None or jax.process_count() == 1 else make_mesh()
    try:
        model = load(args.model, dtype=args.dtype, backend=args.backend, mesh=mesh, quantize=quantization(args),
                     lora=args.lora)
        if args.chat:
            return run_chat(model, template, system=args.system, first_messages=prompts, quiet=args.quiet,
                            generation=dict(generation_options(args),
                                            speculative=speculative_options(args, model.mesh)))
        return _generate(args, model, prompts, speculative=speculative_options(args, model.mesh))
    except jax.errors.JaxRuntimeError as e:  # out of memory, mostly: the first line says what
        raise CliError(one_line(e)) from e


def speculative_options(args: argparse.Namespace, mesh=None):
    """The ``Speculative`` the flags ask for (its draft model loaded like the model, on ``mesh`` too), or
    None."""
    if args.speculative is None:
        return None
    from llm_jax.loading import load
    from llm_jax.speculative import Method, Speculative

    lookup = dict(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    if args.speculative == "ngram":
        return Speculative(method=Method.NGRAM, num_tokens=args.num_speculative_tokens, **lookup)
    draft = load(args.speculative, dtype=args.dtype, backend=args.backend, mesh=mesh)
    return Speculative(method=Method.DRAFT, draft_model=draft, num_tokens=args.num_speculative_tokens, **lookup)


def speculative_fields(m) -> dict[str, float | int]:
    """What speculation did, for the metrics line and the ``--json`` object."""
    return {"proposed_tokens": m.proposed_tokens, "accepted_tokens": m.accepted_tokens,
            "acceptance_rate": m.acceptance_rate, "mean_accepted_length": m.mean_accepted_length}


def quantization(args: argparse.Namespace):
    """The ``Quantization`` that ``--quantize`` / ``--group-size`` ask for, or None."""
    if args.quantize is None:
        return None
    from llm_jax.quantization import parse_quantization

    return parse_quantization(args.quantize, args.group_size)


def _chat_template(model_path: str):
    """Found before JAX starts, so that a model without a chat template fails at once."""
    from llm_jax.chat_template import load_chat_template

    return load_chat_template(model_path)


def _generate(args: argparse.Namespace, model: Model, prompts: list[str | list[int]], speculative=None) -> int:
    import jax

    from llm_jax.generation import generate_stream

    stream = generate_stream(model, prompts, **generation_options(args), speculative=speculative)
    if jax.process_index() != 0:  # runs its part of every step; process 0 reports
        for _ in stream:
            pass
        return 0
    if args.json:
        for _ in stream:
            pass
        report = json_report(args.model, stream)
        if speculative is not None:
            report["metrics"].update(speculative_fields(stream.metrics))
        print(json.dumps(report))
        return 0
    per_prompt = args.num_return_sequences if args.num_beams > 1 else args.n  # completions, prompt-major
    write_stream(stream, sys.stdout, echoes=[prompt_echo(model, p) for p in prompts for _ in range(per_prompt)],
                 with_text=model.tokenizer is not None)
    if not args.quiet:
        fields = metrics_fields(stream.metrics)
        if speculative is not None:
            m = stream.metrics
            fields.append(f"accepted {m.accepted_tokens}/{m.proposed_tokens} ({m.acceptance_rate:.0%}), "
                          f"{m.mean_accepted_length:.2f} tokens/step")
        print_status(fields, sys.stderr)
    return 0


def entry() -> int:
    return run_main(main)
