"""``scripts/serve.py`` / ``python -m llm_jax.serve``: flags, then load → engine → compile → listen.

Flags are checked and the chat template file read before JAX starts, so ``--help`` and most mistakes
answer at once (one line, as every llm_jax command: ``llm_jax.cli.common``). The server listens only once
every step program is compiled (``Engine.warm_up``): a client that can connect gets no compilation
pause. SIGTERM (or Ctrl-C) stops it gracefully: no new connections, in-flight requests get
``--shutdown-timeout`` seconds to finish before they are aborted, then the process exits 0 (130 after
Ctrl-C). SIGTERM during start-up exits 0 at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import pathlib
import re
import signal
import socket
import ssl
import sys
import time

import uvicorn

from llm_jax.cli.common import (
    CliError,
    CliParser,
    non_negative_float,
    non_negative_int,
    positive_int,
    run_main,
)
from llm_jax.cli.generate import DEFAULT_MODEL, _add_speculative_flags, add_quantize_flags, quantization, \
    speculative_options
from llm_jax.server.reasoning import PARSERS as REASONING_PARSERS
from llm_jax.server.tools import PARSERS

API_KEY_ENV = "LLM_JAX_API_KEY"
DESCRIPTION = "Serve a model over HTTP with an OpenAI-compatible API (continuous batching, SSE streaming)."
EPILOG = f"""\
endpoints:
  POST /v1/completions, /v1/chat/completions, /v1/responses (stream: true for Server-Sent Events);
  POST /v1/embeddings, /v1/score, /v1/rerank; GET /v1/models;
  POST /tokenize, /detokenize; GET /health (200 once ready), /version, /metrics (Prometheus).
  A sequence classifier (a *ForSequenceClassification folder: reward models) answers POST /classify instead
  of the generating routes.

api key:
  --api-key or ${API_KEY_ENV}: /v1/*, /tokenize, /detokenize, /score, /rerank and /classify then need
  'Authorization: Bearer KEY'.

examples:
  serve.py                                              # the story model shipped in checkpoints/, port 8000
  serve.py --model path/to/hf-model --served-model-name my-model --max-num-seqs 16 --port 8080
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}}'
"""
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40,
         "tib": 2**40}
log = logging.getLogger("llm_jax.server")


def byte_size(text: str) -> int:
    """``2GiB``, ``512MB``, ``1e9``-free plain bytes → bytes."""
    match = SIZE.match(text)
    if match is None or (match.group(2) or "").lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MB or 1000000, got {text!r}")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").lower()])


def build_parser() -> CliParser:
    parser = CliParser(description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                       help="llama2.c .bin file, Hugging Face model folder, or llm_jax checkpoint folder "
                            "(default: the story model shipped in checkpoints/)")
    model.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the name(s) requests give as 'model' (default: --model as given, or 'stories-1m' for "
                            "the shipped model); the first is reported")
    model.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter and compute dtype")
    model.add_argument("--backend", choices=["auto", "xla", "cpu", "pallas"], default="auto",
                       help="how the model runs (default: %(default)s, by platform)")
    model.add_argument("--mesh", metavar="SPEC", help="shard over devices: 'model=8', ... (default: one device)")
    add_quantize_flags(model)
    model.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="default sampling settings of requests that leave them out: auto, the model's "
                            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                            "max_new_tokens as max_tokens); vllm, the API's neutral ones; or a folder's file "
                            "(default: %(default)s)")
    model.add_argument("--override-generation-config", type=_json_object, default={}, metavar="JSON",
                       help="settings on top of those, e.g. '{\"temperature\": 0.5}'")
    model.add_argument("--chat-template", metavar="FILE",
                       help="a Jinja chat template for /v1/chat/completions (default: the model's own)")
    model.add_argument("--tool-call-parser", choices=PARSERS,
                       help="how to read the tool calls of a model calling tools on its own (tool_choice 'auto'): "
                            "hermes (<tool_call> blocks: Qwen 2.5, Hermes), llama3_json (Llama 3.1 and later), "
                            "mistral ([TOOL_CALLS] and a JSON array: Mistral 7B Instruct v0.3, Nemo)")
    model.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="put a thinking model's <think> reasoning in reasoning_content, apart from the answer: "
                            "qwen3, deepseek_r1")
    model.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's spelling: accepted with --tool-call-parser, which alone enables it here")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=positive_int, default=8, metavar="N",
                        help="sequences in the running batch at most (default: %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=256, metavar="N",
                        help="tokens one step computes at most (default: %(default)s)")
    engine.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="prompt plus completion tokens at most (default: the model's context)")
    engine.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                        help="tokens per KV-cache block (default: %(default)s)")
    cache = engine.add_mutually_exclusive_group()
    cache.add_argument("--num-blocks", type=positive_int, metavar="N",
                       help="KV-cache blocks (default: enough for --max-num-seqs full-length sequences)")
    cache.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                       help="KV-cache size in bytes, or with a unit: 2GiB, 512MB")
    engine.add_argument("--kv-cache-dtype", choices=["auto", "int8", "bfloat16", "float32"], default="auto",
                        help="what the KV cache holds: int8 (a float32 scale per token and head; about half "
                             "bfloat16's bytes), bfloat16, float32; auto: the compute dtype (default: %(default)s)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    engine.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                        help="fcfs: first come, first served; priority: by each request's 'priority' (lower "
                             "first, then arrival; the highest preempted first) (default: %(default)s)")
    engine.add_argument("--embedding-pooling", choices=["last", "mean"], default="last",
                        help="/v1/embeddings: the last token's final hidden state (decoder embedding models: "
                             "Qwen3-Embedding, e5-mistral) or the mean over the input (default: %(default)s)")
    engine.add_argument("--classifier-from-token", nargs="+", metavar="TOKEN",
                        help="serve the language model as a classifier of its next-token logits of these tokens "
                             "(vLLM's classifier_from_token: rerankers such as Qwen3-Reranker with 'no yes'; two "
                             "tokens: the second's share of the two) on /classify, /score and /rerank")
    engine.add_argument("--logits-processors", nargs="+", default=[], metavar="MODULE:FUNCTION",
                        help="your own logits processors, applied to every request (as generate's "
                             "logits_processors: jittable fn(scores_BV, tokens_BS, lengths_B) -> scores_BV), "
                             "by import path, e.g. my_pkg.watermark:green_list")
    engine.add_argument("--max-logprobs", type=non_negative_int, default=20, metavar="N",
                        help="top log-probabilities a request may ask for (default: %(default)s)")
    lora = parser.add_argument_group("LoRA adapters (a request's 'model' names one; all run in the same steps)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="keep --max-loras adapter slots (implied by --lora-modules)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=_lora_module,
                      help="PEFT adapter folders to serve, each as NAME=PATH or vLLM's JSON "
                           "'{\"name\": ..., \"path\": ...}'")
    lora.add_argument("--max-loras", type=positive_int, default=1, metavar="N",
                      help="adapter slots, room for adapters loaded at run time (at least one per --lora-modules; "
                           "default: %(default)s)")
    lora.add_argument("--max-lora-rank", type=positive_int, metavar="R",
                      help="the largest rank of adapters loaded at run time (default: the largest given, or 16)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; the paths "
                           "are the server's: only for trusted clients)")
    speculative = parser.add_argument_group(
        "speculative decoding (each decoding request verifies proposals every step; same output)")
    _add_speculative_flags(speculative)
    speculative.add_argument("--speculative-max-batch", type=positive_int, metavar="N",
                             help="propose only while at most N requests run (default: always)")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    http.add_argument("--port", type=non_negative_int, default=8000,
                      help="port (default: %(default)s; 0: any free one)")
    http.add_argument("--api-key", metavar="KEY", help=f"require this key (default: ${API_KEY_ENV}, else none)")
    http.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (PEM; with "
                                                             "--ssl-keyfile)")
    http.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    http.add_argument("--ssl-ca-certs", metavar="FILE",
                      help="require client certificates signed by these CAs (PEM; mutual TLS)")
    http.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                      help="origins a browser may call the API from (CORS), e.g. http://localhost:3000, or '*' for "
                           "any (default: none; same-origin only)")
    http.add_argument("--max-waiting", type=non_negative_int, default=64, metavar="N",
                      help="completions queued beyond the running batch before 503s (default: %(default)s)")
    http.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="SECONDS",
                      help="after SIGTERM, how long in-flight requests may run before they are aborted "
                           "(default: %(default)s)")
    http.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    return parser


class _Terminated(Exception):
    """SIGTERM arrived before the server was listening."""


def _terminate(signum, frame):
    raise _Terminated


def read_template(args: argparse.Namespace):
    """The chat template: --chat-template's file, else the model's own, else None (chat requests 400)."""
    from llm_jax.chat_template import ChatTemplate, load_chat_template

    try:
        own = load_chat_template(args.model)
    except (ValueError, OSError):  # none, or none that loads: chat requests are refused
        own = None
    if args.chat_template is None:
        return own
    path = pathlib.Path(args.chat_template)
    if not path.is_file():
        raise CliError(f"chat template file {path} does not exist")
    special = own.special_tokens if own is not None else {}
    return ChatTemplate(templates={"default": path.read_text(encoding="utf-8")}, special_tokens=special,
                        source=str(path))


def _with_special_tokens(template, model):
    """The tokenizer's BOS / EOS text for templates that use ``bos_token`` when the model folder names none."""
    if template is None or model.tokenizer is None or template.special_tokens:
        return template
    tok, special = model.tokenizer, {}
    if tok.bos_id is not None:
        special["bos_token"] = tok.id_to_piece(tok.bos_id)
    if tok.eos_ids:
        special["eos_token"] = tok.id_to_piece(tok.eos_ids[0])
    return dataclasses.replace(template, special_tokens=special)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    sock = _bind(args.host, args.port)  # a busy port fails now, not after the compilation
    signal.signal(signal.SIGTERM, _terminate)
    try:
        template = read_template(args)
        engine, model = start_engine(args)
    except _Terminated:
        log.info("terminated while starting")
        return 0
    return _serve(args, engine, model, template, api_key, sock)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked (mistakes exit 2 with one line), and logging set up; ``--model`` must exist."""
    args = parser.parse_args(argv)
    if args.group_size is not None and args.quantize is None:
        parser.error("--group-size needs --quantize")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    if args.ssl_ca_certs is not None and args.ssl_certfile is None:
        parser.error("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        if getattr(args, flag) is not None and not pathlib.Path(getattr(args, flag)).is_file():
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not a file")
    if args.generation_config not in ("auto", "vllm") and not pathlib.Path(args.generation_config).is_dir():
        parser.error(f"--generation-config takes auto, vllm or a folder; {args.generation_config} is not a folder")
    for name, path in args.lora_modules:
        if not (pathlib.Path(path) / "adapter_config.json").is_file():
            parser.error(f"--lora-modules {name}={path}: not a PEFT adapter folder (no adapter_config.json)")
    if args.speculative is not None:
        if args.speculative != "ngram" and not pathlib.Path(args.speculative).exists():
            parser.error(f"--speculative takes 'ngram' or a draft model's path; {args.speculative} does not exist")
        if args.prompt_lookup_min > args.prompt_lookup_max:
            parser.error(f"--prompt-lookup-min {args.prompt_lookup_min} exceeds --prompt-lookup-max "
                         f"{args.prompt_lookup_max}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for name in ("llm_jax", "uvicorn"):  # not JAX's and orbax's chatter
        logging.getLogger(name).setLevel(args.log_level.upper())
    if not pathlib.Path(args.model).exists():
        raise CliError(f"model path {args.model} does not exist")
    return args


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not listening: until the server is ready, connections are refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def sampling_defaults(args: argparse.Namespace, model) -> dict:
    """The request defaults ``--generation-config`` and ``--override-generation-config`` give, checked as
    requests' fields are (a bad value fails the start, naming it)."""
    from llm_jax.server import defaults, protocol
    from llm_jax.server.fields import ApiError, Fields

    try:
        found = defaults.sampling_defaults(args.generation_config, args.model, args.override_generation_config)
        limits = protocol.Limits(vocab_size=model.config.vocab_size, max_logprobs=0, defaults=found)
        protocol.read_sampling(Fields({}), limits)
        protocol.integer(Fields({}), "max_tokens", 1, 2**31 - 1, default=found.get("max_tokens"))
    except (ValueError, ApiError) as error:
        raise CliError(f"--generation-config: {getattr(error, 'message', error)}") from None
    if found:
        log.info("default sampling settings from the generation config (requests' own values win): %s", found)
    return found


def _lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH``, or vLLM's JSON ``{"name": ..., "path": ...}`` (its ``base_model_name`` ignored)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object with name and path") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def start_engine(args: argparse.Namespace):
    """Load the model, build the engine and compile every step program it can run: ``(engine, model)``. A
    sequence classifier, which does not generate, has no engine: ``(None, model)``."""
    from llm_jax.compilation import enable_persistent_cache
    from llm_jax.loading import load, load_lora
    from llm_jax.serving.engine import Engine

    enable_persistent_cache()  # a restart loads its step programs instead of compiling them
    t0 = time.perf_counter()
    model = load(args.model, dtype=args.dtype, backend=args.backend, mesh=args.mesh, quantize=quantization(args))
    if args.classifier_from_token:
        try:
            model = model.as_classifier(args.classifier_from_token)
        except ValueError as error:
            raise CliError(f"--classifier-from-token: {error}") from None
    if model.config.classifier is not None:
        _check_classifier_flags(args, model.config.max_seq_len)
        log.info("loaded %s in %.1f s: a sequence classifier (%d labels), served on /classify", args.model,
                 time.perf_counter() - t0, model.config.classifier.num_labels)
        return None, model
    try:
        adapters = [load_lora(path, model.config, name) for name, path in args.lora_modules]
    except ValueError as error:
        raise CliError(f"--lora-modules: {error}") from None
    lora = args.enable_lora or adapters or args.allow_runtime_lora_updating
    engine = Engine(model, max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_blocks=args.num_blocks,
                    kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                    max_logprobs=args.max_logprobs, speculative=_speculative(args, model.mesh),
                    kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                    lora_adapters=adapters, max_loras=args.max_loras if lora else 0,
                    max_lora_rank=args.max_lora_rank, logits_processors=_processors(args.logits_processors))
    log.info("loaded %s in %.1f s; compiling the engine's step programs", args.model, time.perf_counter() - t0)
    t0 = time.perf_counter()
    count = engine.warm_up()
    log.info("compiled %d step programs in %.1f s (KV cache: %d blocks of %d tokens, %s, max_model_len %d)", count,
             time.perf_counter() - t0, engine.scheduler.pool.num_blocks, engine.block_size, engine.kv_cache_dtype.name,
             engine.max_model_len)
    return engine, model


def _processors(names: list[str]) -> list:
    """``--logits-processors``: each ``module:function`` (or ``module.function``) imported."""
    found = []
    for name in names:
        module, sep, attribute = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attribute) if sep and module and attribute
                         else None)
        except (ImportError, AttributeError) as error:
            raise CliError(f"--logits-processors: cannot import {name!r} ({error})") from None
        if not callable(found[-1]):
            raise CliError(f"--logits-processors: {name!r} is not MODULE:FUNCTION naming a function")
    return found


def _check_classifier_flags(args: argparse.Namespace, context: int) -> None:
    """Flags about generating (speculation, LoRA adapters) have no meaning for a classifier: refused by name;
    ``--max-model-len`` within the model's context."""
    if args.max_model_len is not None and args.max_model_len > context:
        raise CliError(f"--max-model-len {args.max_model_len} exceeds the model's context ({context})")
    flags = (("--speculative", args.speculative is not None), ("--lora-modules", args.lora_modules),
             ("--logits-processors", args.logits_processors),
             ("--enable-lora", args.enable_lora), ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating))
    given = [flag for flag, on in flags if on]
    if given:
        raise CliError(f"{', '.join(given)}: the model is a sequence classifier, which does not generate")


def _speculative(args: argparse.Namespace, mesh=None):
    speculative = speculative_options(args, mesh)
    if speculative is None or args.speculative_max_batch is None:
        return speculative
    return dataclasses.replace(speculative, max_batch=args.speculative_max_batch)


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens (it says nothing when handed a socket)."""

    def __init__(self, config: uvicorn.Config, ready: str):
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        log.info(self.ready)


def server_config(args: argparse.Namespace, model, template, **overrides):
    """The :class:`~llm_jax.server.service.ServerConfig` the flags ask for (``overrides`` replace fields)."""
    from llm_jax.server.service import ServerConfig

    # Default name: --model as given, or the shipped model's folder name when none was.
    default_name = DEFAULT_MODEL.name if args.model == str(DEFAULT_MODEL) else args.model
    names = tuple(args.served_model_name or (default_name,))
    fields = dict(model_names=names, max_waiting=args.max_waiting,
                  chat_template=_with_special_tokens(template, model),
                  tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                  allowed_origins=tuple(args.allowed_origins), scheduling_policy=args.scheduling_policy,
                  embedding_pooling=args.embedding_pooling,
                  allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                  sampling_defaults=sampling_defaults(args, model) if model.config.classifier is None else {},
                  max_model_len=args.max_model_len)
    return ServerConfig(**(fields | overrides))


def _serve(args: argparse.Namespace, engine, model, template, api_key: str | None, sock: socket.socket) -> int:
    from llm_jax.server.app import build_app
    from llm_jax.serving.async_engine import AsyncEngine

    config = server_config(args, model, template, api_key=api_key)
    names = config.model_names
    app = build_app(None if engine is None else AsyncEngine(engine), config, model)
    host = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{host}:{sock.getsockname()[1]}"
    tls = {}
    if args.ssl_certfile:
        tls = dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                                    timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on", **tls),
                     ready=f"ready: serving {names[0]!r} on {url}")
    # uvicorn handles SIGTERM itself (graceful shutdown), then raises it again under the handler it found:
    # this one, so that a graceful stop exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[sock])
    log.info("stopped")
    return 0


def entry() -> int:
    return run_main(main)
