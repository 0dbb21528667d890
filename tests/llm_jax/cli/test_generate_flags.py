"""The generate CLI's flags reach ``generate_stream`` as parsed values."""

import pytest

from llm_jax.cli.generate import build_parser, generation_options
from llm_jax.sampling import Sampling

DEFAULTS = dict(stop_token_ids=[], min_new_tokens=0, n=1, num_beams=1, length_penalty=1.0, early_stopping=False,
                num_return_sequences=1, logprobs=None, raw_logprobs=False, prompt_logprobs=None, kv_cache_dtype=None,
                guided=None)


def test_flags_become_generation_options():
    args = build_parser().parse_args([
        "--model", "m.bin", "--prompt", "a", "--prompt-ids", "1,2", "--prompt", "b", "--max-new-tokens", "7",
        "--ignore-eos", "--stop", "\n\n", "--stop", "THE END", "--temperature", "0.8", "--top-k", "40",
        "--top-p", "0.9", "--min-p", "0.05", "--seed", "11"])
    assert args.prompts == ["a", [1, 2], "b"]  # one batch, in the order given
    assert generation_options(args) == dict(
        max_new_tokens=7, ignore_eos=True, stop=["\n\n", "THE END"],
        sampling=Sampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11), **DEFAULTS)


def test_defaults_are_greedy_without_stops():
    args = build_parser().parse_args(["--model", "m.bin", "--prompt", "a"])
    assert generation_options(args) == dict(max_new_tokens=128, ignore_eos=False, stop=[], sampling=Sampling(),
                                            **DEFAULTS)


def test_control_flags_use_openai_and_transformers_names():
    args = build_parser().parse_args([
        "--model", "m.bin", "--prompt", "a", "--typical-p", "0.5", "--repetition-penalty", "1.2",
        "--presence-penalty", "0.5", "--frequency-penalty", "-0.25", "--logit-bias", "13:2.5,7:-100",
        "--suppress-tokens", "4,5", "--bad-words-ids", "1,2", "--bad-words-ids", "9", "--no-repeat-ngram-size", "3",
        "--min-new-tokens", "2", "--stop-token-ids", "8", "--n", "3", "--num-beams", "4", "--length-penalty", "0.5",
        "--early-stopping", "never", "--num-return-sequences", "2", "--json", "--logprobs", "5", "--raw-logprobs",
        "--prompt-logprobs", "1", "--kv-cache-dtype", "int8"])
    options = generation_options(args)
    assert options["sampling"] == Sampling(
        typical_p=0.5, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.25,
        logit_bias={13: 2.5, 7: -100.0}, suppress_tokens=(4, 5), bad_words_ids=((1, 2), (9,)), no_repeat_ngram_size=3)
    assert {k: options[k] for k in DEFAULTS} == dict(
        stop_token_ids=[8], min_new_tokens=2, n=3, num_beams=4, length_penalty=0.5, early_stopping="never",
        num_return_sequences=2, logprobs=5, raw_logprobs=True, prompt_logprobs=1, kv_cache_dtype="int8", guided=None)
    assert build_parser().parse_args(["--model", "m", "--logit-bias", '{"50256": -100}']).logit_bias == {50256: -100.0}


@pytest.mark.parametrize("flags, message", [
    (["--logit-bias", "13=2"], "token:bias pairs"),
    (["--early-stopping", "soon"], "true, false or never"),
    (["--repetition-penalty", "0"], "a number > 0"),
])
def test_bad_control_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--model", "m.bin", "--prompt", "a", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
