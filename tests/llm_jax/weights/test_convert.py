"""Conversion to llm_jax checkpoints: exact round trips, bfloat16, the CLI, and interrupted conversions."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.tokenizer import load_tokenizer
from llm_jax.weights import checkpoint
from llm_jax.weights.checkpoint import is_checkpoint, load_checkpoint
from llm_jax.weights.convert import convert
from llm_jax.weights.placement import leaves_by_path
from tests.hf_models import save_tiny_llama

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The dog ran to the park. He saw a big",
           "Tom and Sue were friends. One day"]


def sources(stories260k_dir):
    return {"bin": stories260k_dir / "stories260K.bin", "hf": stories260k_dir / "hf"}


@pytest.mark.parametrize("kind", ["bin", "hf"])
def test_stories260k_round_trip(stories260k_dir, tmp_path, kind):
    source = sources(stories260k_dir)[kind]
    events = []
    convert(source, tmp_path / "ckpt", progress=events.append)
    direct, converted = llm_jax.load(source), llm_jax.load(tmp_path / "ckpt")
    assert converted.config == direct.config
    for path, x in leaves_by_path(direct.params).items():  # both in the layout load() chose
        np.testing.assert_array_equal(np.asarray(leaves_by_path(converted.params)[path]), np.asarray(x))
    assert (converted.eos_ids, converted.stop_ids) == (direct.eos_ids, direct.stop_ids)
    assert converted.tokenizer.encode(PROMPTS[0]) == direct.tokenizer.encode(PROMPTS[0])
    assert load_tokenizer(tmp_path / "ckpt").eos_ids == direct.tokenizer.eos_ids
    # One progress event per tensor: 47 per-layer or global source tensors, then our 11 stacked tensors.
    reads = [e for e in events if e.stage == "read"]
    saves = [e for e in events if e.stage == "save"]
    assert [e.done for e in reads] == list(range(1, reads[0].total + 1)) and reads[0].total == 9 * 5 + 2
    assert len(saves) == saves[0].total == len(jax.tree.leaves(direct.params))


def test_bfloat16_conversion_keeps_greedy_output_close(stories260k_dir, tmp_path):
    source = sources(stories260k_dir)["bin"]
    convert(source, tmp_path / "bf16", dtype="bfloat16")
    config, params, meta = load_checkpoint(tmp_path / "bf16")
    assert meta.param_dtype == config.param_dtype == config.compute_dtype == "bfloat16"
    f32 = llm_jax.load(source)
    for path, x in leaves_by_path(f32.params).items():  # round-to-nearest casts
        np.testing.assert_array_equal(np.asarray(leaves_by_path(params)[path]), np.asarray(x.astype("bfloat16")))
    # The float32 reference is transformers on the hf/ copy (equal to llm_jax float32 token for token).
    reference = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    reference.generation_config.eos_token_id = None  # run all 48 tokens, as ignore_eos does
    bf16 = llm_jax.load(tmp_path / "bf16")
    agree = []
    for result in llm_jax.generate(bf16, PROMPTS, max_new_tokens=48, ignore_eos=True):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([result.prompt_ids]), max_new_tokens=48,
                                          do_sample=False)[0, len(result.prompt_ids):].numpy()
        same = np.asarray(result.output_ids) == expected
        agree.append(len(same) if same.all() else int(np.argmin(same)))
    print(f"bfloat16 greedy tokens equal to float32 before the first divergence: {agree} of 48")
    assert min(agree) >= 16, agree


def test_refuses_to_overwrite_and_bad_arguments(stories260k_dir, tmp_path):
    source = sources(stories260k_dir)["bin"]
    convert(source, tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="already exists; pass force=True"):
        convert(source, tmp_path / "ckpt")
    convert(source, tmp_path / "ckpt", force=True, dtype="bfloat16")
    assert load_checkpoint(tmp_path / "ckpt")[2].param_dtype == "bfloat16"
    with pytest.raises(ValueError, match="already an llm_jax checkpoint"):
        convert(tmp_path / "ckpt", tmp_path / "again")
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert(source, tmp_path / "int", dtype="int8")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "missing.bin", tmp_path / "none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failure_after_params_are_written_leaves_nothing(stories260k_dir, tmp_path, monkeypatch):
    def failing_copy(*args):
        raise OSError("injected: disk full")

    monkeypatch.setattr(checkpoint.shutil, "copyfile", failing_copy)
    with pytest.raises(OSError, match="injected"):
        convert(sources(stories260k_dir)["bin"], tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", ["read", "save"])
def test_killed_conversion_never_leaves_a_checkpoint(stories260k_dir, tmp_path, stage):
    """SIGKILL midway (while reading source tensors, or with the staging folder half written): nothing
    appears under the final name, and a new conversion succeeds."""
    dest, marker = tmp_path / "ckpt", tmp_path / "marker"
    script = textwrap.dedent(f"""
        import pathlib, time
        from llm_jax.weights.convert import convert
        def progress(event):
            if event.stage == {stage!r} and event.done == event.total // 2:
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(600)
        convert({str(sources(stories260k_dir)["bin"])!r}, {str(dest)!r}, progress=progress)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the conversion never reached the kill point"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not dest.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "marker"]
    assert all(name.startswith("ckpt.tmp-") for name in leftovers), leftovers
    assert len(leftovers) == (1 if stage == "save" else 0)  # the staging folder exists once saving starts
    convert(sources(stories260k_dir)["bin"], dest)
    assert is_checkpoint(dest)


def test_cli(stories260k_dir, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "convert.py"), *map(str, args)],
                              env=ENV, capture_output=True, text=True, timeout=300)

    source = sources(stories260k_dir)["hf"]
    first = run(source, tmp_path / "ckpt", "--dtype", "float32")
    assert first.returncode == 0, first.stderr
    assert "read: 100%" in first.stderr and "save: 100%" in first.stderr and "wrote" in first.stderr
    again = run(source, tmp_path / "ckpt", "--quiet")
    assert again.returncode == 1 and again.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt'} already exists; pass force=True (--force) to overwrite it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_special_token_ids_only_in_config_json_travel(tmp_path):
    """transformers derives generation_config.json from config.json; so does a conversion without one."""
    save_tiny_llama(tmp_path / "hf", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=[2, 5])
    (tmp_path / "hf" / "generation_config.json").unlink()
    convert(tmp_path / "hf", tmp_path / "ckpt")
    derived = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert derived == {"bos_token_id": 1, "eos_token_id": [2, 5]}
