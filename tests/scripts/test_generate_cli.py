"""``scripts/generate.py`` run as a user runs it: a subprocess, its stdout, stderr and exit status.

Expected outputs come from references: sentencepiece for the stories260K ids and text, ``transformers``
(chat template rendering and greedy generation) for the chat replies, and the ``--json`` run for the
text modes. Runs share a persistent XLA compilation cache, so a shape compiled once is not compiled
again by a later run; each run still starts JAX and loads the model.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading

import pytest
import sentencepiece

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "generate.py"
TIMEOUT_S = 600  # a cold JAX start and compile on a loaded 2-core machine

STORY_PROMPT = "Once upon a time"
# "Tom had a dog" as stories260K's sentencepiece ids, without BOS (prompt ids are used exactly as given).
DOG_IDS = [274, 287, 381, 261, 400, 428]
# Appears early in the continuation of DOG_IDS and not in the first 40 tokens of STORY_PROMPT's, so the
# second prompt of the batch finishes (by stop string) long before the first (by length).
STOP = "Sam"
MAX_NEW = 40
METRICS_LINE = re.compile(r"\[\d+ tokens · ttft \d+ ms · itl p50 [\d.]+ ms p90 [\d.]+ ms · [\d.]+ tok/s · "
                          r"compile [\d.]+ s\]")
# A Llama-2-like chat format, written with the stories260K tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% else %}Answer: {{ m['content'] | trim }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The tree under test first on the path; a compilation cache shared by this module's runs."""
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run(env, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=TIMEOUT_S, cwd=REPO_ROOT)


def assert_one_error_line(proc: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    """Exit status ``status``, no traceback, and one ``error:`` line (the last) holding every fragment."""
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1]
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def stories_bin(stories260k_dir) -> pathlib.Path:
    return stories260k_dir / "stories260K.bin"


@pytest.fixture(scope="module")
def sp(stories260k_dir) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(stories260k_dir / "tok512.model"))


@pytest.fixture(scope="module")
def chat_model(stories260k_dir, tmp_path_factory) -> pathlib.Path:
    """The stories260K Hugging Face copy with a chat template added to its tokenizer config."""
    hf, folder = stories260k_dir / "hf", tmp_path_factory.mktemp("stories_chat")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(hf / name)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def weights_only_model(stories260k_dir, tmp_path_factory) -> pathlib.Path:
    """stories260K without any tokenizer file: a model that takes and gives token ids only."""
    folder = tmp_path_factory.mktemp("stories_no_tokenizer")
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(stories260k_dir / "hf" / name)
    return folder


# --- fast: answered before JAX starts -----------------------------------------------------------------


def test_help_is_fast_and_does_not_import_jax(env):
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "print('jax imported:', 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("jax imported: False")
    for flag in ("--model", "--prompt", "--prompt-ids", "--chat", "--system", "--max-new-tokens", "--ignore-eos",
                 "--stop", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--dtype", "--backend",
                 "--json", "--quiet"):
        assert flag in proc.stdout


@pytest.mark.parametrize("args, status, fragments", [
    (["--model", "{bin}"], 2, ["--prompt"]),  # nothing to generate from
    (["--model", "{bin}", "--prompt", "x", "--top-p", "1.5"], 2, ["--top-p", "1.5"]),
    (["--model", "{bin}", "--prompt", "x", "--temperature", "-1"], 2, ["--temperature", "-1"]),
    (["--model", "{bin}", "--prompt", "x", "--max-new-tokens", "0"], 2, ["--max-new-tokens", "0"]),
    (["--model", "{bin}", "--prompt-ids", "1,x"], 2, ["--prompt-ids", "1,x"]),
    (["--model", "{bin}", "--prompt", "x", "--dtype", "float16"], 2, ["--dtype", "float16"]),
    (["--model", "{bin}", "--prompt", "x", "--no-such-flag"], 2, ["--no-such-flag"]),
    (["--model", "{bin}", "--prompt", "x", "--system", "hi"], 2, ["--system needs --chat"]),
    (["--model", "{bin}", "--chat", "--json"], 2, ["--json", "--chat"]),
    (["--model", "{bin}", "--prompt", "-", "--prompt", "-"], 2, ["stdin"]),
    (["--model", "{missing}", "--prompt", "x"], 1, ["model path", "does not exist"]),
    (["--model", "{bin}", "--chat"], 1, ["no chat template"]),
])
def test_usage_errors(env, stories_bin, tmp_path, args, status, fragments):
    paths = {"bin": stories_bin, "missing": tmp_path / "nowhere.bin"}
    proc = run(env, *[a.format(**paths) for a in args])
    assert_one_error_line(proc, status, *fragments)


# --- generation ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch_json(env, stories_bin) -> dict:
    """A batch of a text prompt and an id prompt, with a stop string, as ``--json``."""
    proc = run(env, "--model", stories_bin, "--prompt", STORY_PROMPT, "--prompt-ids", ",".join(map(str, DOG_IDS)),
               "--stop", STOP, "--max-new-tokens", MAX_NEW, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one JSON object


def test_json_schema_and_values(batch_json, stories_bin, sp):
    report = batch_json
    assert set(report) == {"model", "results", "metrics"}
    assert report["model"] == str(stories_bin)
    metrics = report["metrics"]
    assert set(metrics) == {"compile_s", "ttft_s", "itl_s", "decode_tokens_per_s"}
    for name, value in metrics.items():
        assert type(value) is float and math.isfinite(value) and value >= 0, (name, value)
    assert metrics["ttft_s"] > 0 and metrics["decode_tokens_per_s"] > 0

    story, dog = report["results"]
    for result in (story, dog):
        assert set(result) == {"prompt", "prompt_ids", "output_ids", "text", "finish_reason"}
        assert all(type(i) is int and 0 <= i < sp.get_piece_size() for i in result["prompt_ids"] + result["output_ids"])
        assert type(result["text"]) is str
        assert result["finish_reason"] in ("eos", "length", "stop")
    assert story["prompt"] == STORY_PROMPT and dog["prompt"] is None
    assert story["prompt_ids"] == [sp.bos_id(), *sp.encode(STORY_PROMPT)]  # BOS added to text prompts
    assert dog["prompt_ids"] == DOG_IDS  # ids used exactly as given

    # The story runs to the token budget; its text is what its tokens add to the prompt's text.
    assert story["finish_reason"] == "length" and len(story["output_ids"]) == MAX_NEW
    assert STOP not in story["text"]
    assert sp.decode(story["prompt_ids"] + story["output_ids"]) == sp.decode(story["prompt_ids"]) + story["text"]
    # The dog story meets the stop string: its text ends before it; the ids that completed it are kept.
    continuation = sp.decode(dog["prompt_ids"] + dog["output_ids"])[len(sp.decode(dog["prompt_ids"])):]
    assert dog["finish_reason"] == "stop" and len(dog["output_ids"]) < MAX_NEW
    assert STOP in continuation and dog["text"] == continuation[:continuation.index(STOP)]
    assert STOP not in sp.decode(dog["prompt_ids"] + dog["output_ids"][:-1])[len(sp.decode(dog["prompt_ids"])):]


def test_streams_a_prompt_read_from_stdin(env, stories_bin, batch_json):
    proc = run(env, "--model", stories_bin, "--prompt", "-", "--stop", STOP, "--max-new-tokens", MAX_NEW,
               stdin=STORY_PROMPT + "\n")
    assert proc.returncode == 0, proc.stderr
    story = batch_json["results"][0]
    assert proc.stdout == STORY_PROMPT + story["text"] + "\n"  # the same greedy tokens as in the batch
    assert "Lily" in proc.stdout  # a story, not noise
    assert METRICS_LINE.fullmatch(proc.stderr.strip().splitlines()[-1]), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"[{MAX_NEW} tokens ")


def test_batch_prints_in_prompt_order_and_quiet_prints_no_metrics(env, stories_bin, batch_json, sp):
    proc = run(env, "--model", stories_bin, "--prompt", STORY_PROMPT, "--prompt-ids", ",".join(map(str, DOG_IDS)),
               "--stop", STOP, "--max-new-tokens", MAX_NEW, "--quiet")
    assert proc.returncode == 0, proc.stderr
    story, dog = batch_json["results"]
    # The second prompt finished first, yet prints second; an id prompt echoes its decoded text.
    assert proc.stdout == (f"--- 1/2 ---\n{STORY_PROMPT}{story['text']}\n"
                           f"--- 2/2 ---\n{sp.decode(DOG_IDS)}{dog['text']}\n")
    assert proc.stderr == ""


def test_model_without_tokenizer_takes_and_gives_ids(env, weights_only_model, batch_json):
    story = batch_json["results"][0]
    proc = run(env, "--model", weights_only_model, "--prompt-ids", ",".join(map(str, story["prompt_ids"])),
               "--max-new-tokens", MAX_NEW, "--json")
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(proc.stdout)["results"]
    assert result["prompt"] is None and result["text"] is None and result["finish_reason"] == "length"
    # The Hugging Face copy of the weights continues exactly as the llama2.c file did.
    assert result["prompt_ids"] == story["prompt_ids"] and result["output_ids"] == story["output_ids"]


@pytest.mark.parametrize("case", ["not a model", "prompt too long", "text prompt without tokenizer",
                                  "id outside the vocabulary"])
def test_errors_after_loading(env, case, stories_bin, weights_only_model, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    args, fragments = {
        "not a model": (["--model", tmp_path, "--prompt", "x"], ["not a model folder"]),
        "prompt too long": (["--model", stories_bin, "--prompt-ids", ",".join(["1"] * 600)],
                            ["600 tokens", "context of 512 tokens"]),
        "text prompt without tokenizer": (["--model", weights_only_model, "--prompt", "x"], ["no tokenizer"]),
        "id outside the vocabulary": (["--model", stories_bin, "--prompt-ids", "1,512"], ["[512]", "vocabulary"]),
    }[case]
    assert_one_error_line(run(env, *args), 1, *fragments)


# --- chat ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_chat(chat_model):
    """Replies by transformers: its chat-template rendering, its tokenizer, greedy generation."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model).eval()

    def reply(messages: list[dict], max_new_tokens: int) -> tuple[str, int]:
        """The reply's text and the tokens the conversation then fills."""
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)[0].tolist()
        prompt_text = tokenizer.decode(ids, skip_special_tokens=True)
        return tokenizer.decode(out, skip_special_tokens=True)[len(prompt_text):], len(out)

    return reply


class LineReader:
    """Lines of a pipe, read by a thread so that the test can wait for them with a timeout."""

    def __init__(self, pipe):
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self._lines.put(line)
        self._lines.put(None)  # end of the stream

    def until(self, predicate, count: int) -> list[str]:
        """Lines up to the ``count``-th one that satisfies ``predicate``."""
        seen: list[str] = []
        while sum(map(predicate, seen)) < count:
            line = self._lines.get(timeout=TIMEOUT_S)
            assert line is not None, "".join(seen)
            seen.append(line)
        return seen

    def rest(self) -> str:
        return "".join(iter(lambda: self._lines.get(timeout=TIMEOUT_S), None))


def test_chat_keeps_history_through_the_template_and_ends_on_ctrl_c(env, chat_model, reference_chat):
    system, first, second, max_new = "A story.", STORY_PROMPT, "What did Lily see?", 12
    # The first message comes from --prompt, the rest from stdin, which stays open: a live conversation.
    command = [sys.executable, str(SCRIPT), "--model", str(chat_model), "--chat", "--system", system,
               "--prompt", first, "--max-new-tokens", str(max_new)]
    # The CLI gets Ctrl-C's default action (KeyboardInterrupt) even where this test runs with SIGINT
    # ignored — a job started in the background by a non-interactive shell — which a child inherits:
    # a small launcher restores it, then becomes the CLI.
    launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    with subprocess.Popen([sys.executable, "-c", launcher, *command[1:]], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=REPO_ROOT) as proc:  # leaving closes the pipes and waits
        try:
            stderr = LineReader(proc.stderr)
            proc.stdin.write(f"{second}\n{'Once upon a time ' * 150}\n/reset\n{second}\n")
            proc.stdin.flush()
            status = [line.strip() for line in stderr.until(lambda line: line.startswith("[context"), 3)]
            proc.send_signal(signal.SIGINT)  # waiting for the next message: Ctrl-C leaves, without a traceback
            proc.wait(timeout=TIMEOUT_S)  # Ctrl-C lands after a compile in progress
            stdout, rest = proc.stdout.read(), stderr.rest()
        finally:
            proc.kill()
    start = [{"role": "system", "content": system}]
    r1, used1 = reference_chat([*start, {"role": "user", "content": first}], max_new)
    r2, used2 = reference_chat([*start, {"role": "user", "content": first}, {"role": "assistant", "content": r1},
                                {"role": "user", "content": second}], max_new)
    r3, used3 = reference_chat([*start, {"role": "user", "content": second}], max_new)  # after /reset
    assert stdout == f"{r1}\n{r2}\n{r3}\n"
    assert r2 != r3  # the history changed the reply
    context = [re.match(r"\[context (\d+)/(\d+) tokens · ", line) for line in status if line.startswith("[context")]
    assert [(int(m[1]), int(m[2])) for m in context] == [(used1, 512), (used2, 512), (used3, 512)]
    too_long = [line for line in status if "no longer fits" in line]
    assert len(too_long) == 1 and "context of 512 tokens" in too_long[0] and "/reset" in too_long[0]
    assert "[conversation reset]" in status
    assert proc.returncode == 130
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "interrupted"


def test_chat_commands(env, chat_model):
    proc = run(env, "--model", chat_model, "--chat", "--quiet", stdin=f"/help\n\n/exit\n{STORY_PROMPT}\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # /exit left before the message after it
    assert "/reset" in proc.stderr and "/exit" in proc.stderr and "[context" not in proc.stderr
