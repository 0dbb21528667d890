"""The reasoning reader: a thinking model's <think> reasoning apart from its answer, as ``transformers``'
reader of Qwen 3's answers parses it (given the prompt, which may have opened the reasoning already),
with tool calls read from the answer; streamed in any pieces, as the whole."""

import json
import random

import pytest
import transformers
from test_tools import read
from transformers.cli.serving.utils import get_response_template

from llm_jax.server import reasoning, tools

TRANSFORMERS_PARSER = get_response_template(None, transformers.Qwen3Config())
PROMPT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
CASES = [  # (the prompt's end, the output)
    (PROMPT, "<think>\nLet me think.\n</think>\n\nThe answer is 4."),
    (PROMPT, "The answer is 4."),
    (PROMPT, "  The answer, with leading space."),
    (PROMPT + "<think>\n", "Let me think.\n</think>\n\nThe answer."),
    (PROMPT + "<think>\n", "Still thinking, cut short"),
    (PROMPT, "<think>\nstill thinking\n"),
    (PROMPT, "<think>\nI should call add.\n</think>\n\n" + CALL),
    (PROMPT, "<think>\nA </thi tricky </think that is not one.\n\nStill.\n</think>\nFour <b>4</b>."),
    (PROMPT + "<think>\n\n</think>\n\n", "Plain answer."),
    (PROMPT, "<think></think>Answer right away."),
]


@pytest.fixture(scope="module")
def hf_tokenizer(stories260k_dir):
    return transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")


def reader(prompt: str) -> tools.Reader:
    calling = tools.ToolCalling(tools=(tools.Tool("add"),), choice="auto")
    return reasoning.output_reader(calling, "hermes", "qwen3", prompt=prompt)()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reasoning_reads_as_transformers(hf_tokenizer, case):
    prompt, text = CASES[case]
    r = reader(prompt)
    whole = r.feed(text)
    whole += r.finish()
    theirs = hf_tokenizer.parse_response(text, TRANSFORMERS_PARSER, prefix=prompt)
    assert whole.reasoning == theirs.get("reasoning_content", "")
    assert whole.content == (theirs.get("content", "") if not text.startswith(" ") else text)  # kept as written
    calls = [(c.name, json.loads(c.arguments)) for c in whole.calls]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in theirs.get("tool_calls", [])]
    rng = random.Random(case)
    for _ in range(30):
        pieces = tools.Read()
        r = reader(prompt)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10))))
        for i, j in zip([0, *cuts], [*cuts, len(text)]):
            pieces += r.feed(text[i:j])
        pieces += r.finish()
        assert (pieces.reasoning, pieces.content, [(c.name, c.arguments) for c in pieces.calls]) == (
            whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls])


class ThinkingTokenizer:
    """A tokenizer that has </think> as one token (id 7)."""

    def piece_to_id(self, piece):
        return 7 if piece == "</think>" else None


def test_constraints_start_after_the_reasoning():
    assert reasoning.constraint_start(ThinkingTokenizer(), PROMPT) == 7
    assert reasoning.constraint_start(ThinkingTokenizer(), PROMPT + "<think>\n") == 7
    assert reasoning.constraint_start(ThinkingTokenizer(), PROMPT + "<think>\n\n</think>\n\n") is None
    assert reasoning.constraint_start(None, PROMPT) is None
    named = tools.ToolCalling(tools=(tools.Tool("add"),), choice=tools.Named("add"))
    r = reasoning.output_reader(named, None, "qwen3", prompt=PROMPT)()
    assert read(r, '<think>\nadd two\n</think>\n\n{"a": 2}') == ("", [(0, "add", '{"a": 2}')])
    r = reasoning.output_reader(named, None, "qwen3", prompt=PROMPT)()
    result = r.feed('<think>\nadd two\n</think>\n\n{"a": 2}')
    assert result.reasoning == "add two"


def test_without_a_parser_the_output_is_untouched():
    assert reasoning.output_reader(None, None, None, prompt=PROMPT)() is None
    r = reasoning.output_reader(None, None, "deepseek_r1", prompt=PROMPT + "<think>\n")()
    assert read(r, "x\n</think>\n\ny") == ("y", []) and r.num_calls == 0
    forced = tools.ToolCalling(tools=(tools.Tool("add"),), choice="required")
    assert isinstance(reasoning.output_reader(forced, None, None, prompt=PROMPT)(), tools.ArrayReader)
