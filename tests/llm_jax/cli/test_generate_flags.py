"""The generate CLI's flags reach ``generate_stream`` as parsed values."""

from llm_jax.cli.generate import build_parser, generation_options
from llm_jax.sampling import Sampling


def test_flags_become_generation_options():
    args = build_parser().parse_args([
        "--model", "m.bin", "--prompt", "a", "--prompt-ids", "1,2", "--prompt", "b", "--max-new-tokens", "7",
        "--ignore-eos", "--stop", "\n\n", "--stop", "THE END", "--temperature", "0.8", "--top-k", "40",
        "--top-p", "0.9", "--min-p", "0.05", "--seed", "11"])
    assert args.prompts == ["a", [1, 2], "b"]  # one batch, in the order given
    assert generation_options(args) == dict(
        max_new_tokens=7, ignore_eos=True, stop=["\n\n", "THE END"],
        sampling=Sampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11))


def test_defaults_are_greedy_without_stops():
    args = build_parser().parse_args(["--model", "m.bin", "--prompt", "a"])
    assert generation_options(args) == dict(max_new_tokens=128, ignore_eos=False, stop=[], sampling=Sampling())
