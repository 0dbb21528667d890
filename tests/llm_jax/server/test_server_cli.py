"""``python -m llm_jax.serve`` before it loads anything: help and mistakes answer at once, in one line."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
from server_process import REPO_ROOT

import llm_jax
from llm_jax.server.cli import byte_size


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_jax.serve", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)


def _one_error_line(proc: subprocess.CompletedProcess, status: int, fragment: str) -> None:
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert fragment in line


def test_help_lists_the_flags_without_starting_jax():
    proc = _serve("--help")
    assert proc.returncode == 0
    for flag in ("--served-model-name", "--max-num-seqs", "--kv-cache-memory", "--chat-template", "--api-key",
                 "--max-waiting", "--shutdown-timeout", "--no-prefix-caching", "--kv-cache-dtype", "--speculative",
                 "--num-speculative-tokens", "--speculative-max-batch", "--quantize", "--group-size",
                 "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser", "--allowed-origins",
                 "--scheduling-policy", "--embedding-pooling", "--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs",
                 "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--allow-runtime-lora-updating",
                 "--generation-config", "--override-generation-config"):
        assert flag in proc.stdout
    check = subprocess.run([sys.executable, "-c", "import sys, llm_jax.server.cli, llm_jax.serve; "
                            "print('jax' in sys.modules)"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert check.stdout.strip() == "False", check.stderr


def test_mistakes_are_one_line():
    _one_error_line(_serve("--max-num-seqs", "0"), 2, "--max-num-seqs")
    _one_error_line(_serve("--kv-cache-memory", "lots"), 2, "--kv-cache-memory")
    _one_error_line(_serve("--num-blocks", "8", "--kv-cache-memory", "1GiB"), 2, "not allowed with")
    _one_error_line(_serve("--kv-cache-dtype", "fp8"), 2, "--kv-cache-dtype")
    _one_error_line(_serve("--speculative", "no/such/draft"), 2, "no/such/draft does not exist")
    _one_error_line(_serve("--speculative", "ngram", "--prompt-lookup-min", "5"), 2, "exceeds --prompt-lookup-max 4")
    _one_error_line(_serve("--speculative-max-batch", "0"), 2, "--speculative-max-batch")
    _one_error_line(_serve("--quantize", "int3"), 2, "--quantize")
    _one_error_line(_serve("--group-size", "32"), 2, "--group-size needs --quantize")
    _one_error_line(_serve("--enable-auto-tool-choice"), 2, "--enable-auto-tool-choice needs --tool-call-parser")
    _one_error_line(_serve("--ssl-certfile", "cert.pem"), 2, "--ssl-certfile and --ssl-keyfile go together")
    _one_error_line(_serve("--ssl-ca-certs", "ca.pem"), 2, "--ssl-ca-certs needs --ssl-certfile")
    _one_error_line(_serve("--ssl-certfile", "no/cert.pem", "--ssl-keyfile", "no/key.pem"), 2, "is not a file")
    _one_error_line(_serve("--tool-call-parser", "pythonic"), 2, "--tool-call-parser")
    _one_error_line(_serve("--lora-modules", "tales"), 2, "'tales' is not NAME=PATH")
    _one_error_line(_serve("--lora-modules", '{"name": "a"}'), 2, "is not a JSON object with name and path")
    _one_error_line(_serve("--lora-modules", "a=no/such/adapter"), 2, "a=no/such/adapter: not a PEFT adapter folder")
    _one_error_line(_serve("--max-loras", "0"), 2, "--max-loras")
    _one_error_line(_serve("--generation-config", "no/such/folder"), 2, "no/such/folder is not a folder")
    _one_error_line(_serve("--override-generation-config", "[1]"), 2, "is not a JSON object")
    _one_error_line(_serve("--model", "no/such/model"), 1, "no/such/model does not exist")
    _one_error_line(_serve("--chat-template", "no/such/template.jinja"), 1, "template.jinja does not exist")


@pytest.mark.parametrize("text, expected", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("100", 100),
                                            ("1.5 KiB", 1536)])
def test_byte_sizes(text, expected):
    assert byte_size(text) == expected


def engine_options(monkeypatch, argv: list[str]) -> dict:
    """The options the server's command line gives the engine (the model and the engine are stand-ins)."""
    from llm_jax.server import cli

    class Built(Exception):
        pass

    def engine(model, **options):
        raise Built(options)

    monkeypatch.setattr("llm_jax.compilation.enable_persistent_cache", lambda: None)
    monkeypatch.setattr("llm_jax.loading.load", lambda *args, **kwargs: types.SimpleNamespace(
        mesh=None, config=types.SimpleNamespace(classifier=None)))
    monkeypatch.setattr("llm_jax.serving.engine.Engine", engine)
    with pytest.raises(Built) as built:
        cli.start_engine(cli.build_parser().parse_args(argv))
    return built.value.args[0]


@pytest.mark.parametrize("flag, expected", [("int8", "int8"), ("bfloat16", "bfloat16"), ("auto", None)])
def test_the_kv_cache_dtype_reaches_the_engine(monkeypatch, flag, expected):
    """``--kv-cache-dtype`` is the engine's ``kv_cache_dtype`` (auto: None, the compute dtype; the engine's
    own tests run int8 caches)."""
    assert engine_options(monkeypatch, ["--kv-cache-dtype", flag])["kv_cache_dtype"] == expected


def test_logits_processors_reach_the_engine(monkeypatch):
    """``--logits-processors MODULE:FUNCTION`` imports each function for the engine
    (``tests/llm_jax/serving/test_engine_processors.py`` runs them); bad names fail the start."""
    from llm_jax.cli.common import CliError
    from tests.llm_jax.test_custom_logits_processors import green_list, no_token_twice

    module = "tests.llm_jax.test_custom_logits_processors"
    options = engine_options(monkeypatch, ["--logits-processors", f"{module}:green_list", f"{module}.no_token_twice"])
    assert options["logits_processors"] == [green_list, no_token_twice]
    for name, message in ((f"{module}:blue_list", "cannot import"), ("no_such_module:f", "cannot import"),
                          (f"{module}:PROMPTS", "naming a function")):
        with pytest.raises(CliError, match=message):
            engine_options(monkeypatch, ["--logits-processors", name])


def test_quantize_reaches_the_loader(monkeypatch):
    """``--quantize int4-asym --group-size 64`` loads the model quantized so (stand-ins for the loader and
    the engine; the engine's own tests run quantized models)."""
    from llm_jax.server import cli

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded(kwargs)

    monkeypatch.setattr("llm_jax.compilation.enable_persistent_cache", lambda: None)
    monkeypatch.setattr("llm_jax.loading.load", load)
    with pytest.raises(Loaded) as loaded:
        cli.start_engine(cli.build_parser().parse_args(["--quantize", "int4-asym", "--group-size", "64"]))
    assert loaded.value.args[0]["quantize"] == llm_jax.Quantization(bits=4, group_size=64, offsets=True)
    with pytest.raises(Loaded) as loaded:
        cli.start_engine(cli.build_parser().parse_args([]))
    assert loaded.value.args[0]["quantize"] is None
