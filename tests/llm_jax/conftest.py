"""Fixtures shared by the llm_jax tests: stories260K and a near copy of it (a draft that agrees with it
often but not always); tokenizer folders built with ``tokenizers`` (no hub) for the text-layer tests."""

import json
import pathlib

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import llm_jax
from distribution import near_copy
from tests.hf_models import save_peft_adapter


@pytest.fixture(scope="module")
def stories(stories260k_dir):
    return llm_jax.load(stories260k_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def near_draft(stories):
    return near_copy(stories)


@pytest.fixture(scope="session")
def story_adapters(stories260k_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
    """PEFT LoRA adapters of stories260K's Hugging Face copy, written by PEFT: "tales" (every projection,
    rank 4), "poems" (q, v and down projections, rank 8) and "wide" (rank 16)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("story_adapters")

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()

    save_peft_adapter(base(), folder / "tales", seed=1, scale=0.3)
    save_peft_adapter(base(), folder / "poems", seed=2, scale=0.5, r=8, lora_alpha=4,
                      target_modules=["q_proj", "v_proj", "down_proj"])
    save_peft_adapter(base(), folder / "wide", seed=3, r=16)
    return {name: folder / name for name in ("tales", "poems", "wide")}


# Text the test tokenizers are trained on and tested with: English, Chinese, code, emoji, whitespace runs.
CORPUS = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "The quick brown fox jumps over the lazy dog. THE END!",
    "我们今天去公园散步，天气很好。中文字符和标点符号。",
    "日本語のテキストも少し。한국어 문장도 있습니다.",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    "Emoji: 😀😃😄 👍🏽 🇫🇷 ❤️ family 👨‍👩‍👧‍👦 done.",
    "    leading spaces, trailing spaces    ",
    "multiple   spaces\tand\ttabs\n\n\nand newlines\r\nwindows",
    "Ünïcödé àccents: café, naïve, façade, Straße, Ελληνικά, русский текст.",
    "",
)

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Special tokens of the three chat formats the chat-template tests render (Llama 3, ChatML, Gemma).
CHAT_SPECIAL_TOKENS = (
    "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
)
NON_SPECIAL_ADDED = ("<think>", "</think>")  # added tokens that are not special (Qwen 3's reasoning markers)


def train_byte_level_bpe() -> tokenizers.Tokenizer:
    """A Llama-3 / Qwen style tokenizer: byte-level BPE, a post-processor adding BOS, special tokens."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[BOS, EOS, EOT, *CHAT_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    return tokenizer


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory) -> pathlib.Path:
    """A model folder: tokenizer.json plus the config files a Llama 3 checkpoint ships with it."""
    folder = tmp_path_factory.mktemp("byte_level_bpe")
    tokenizer = train_byte_level_bpe()
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, EOT)}
    write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    })
    write_json(folder / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]})
    write_json(folder / "config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": None})
    return folder


def write_json(path: pathlib.Path, content: dict) -> None:
    path.write_text(json.dumps(content, ensure_ascii=False, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def text_corpus() -> tuple[str, ...]:
    return CORPUS


@pytest.fixture(scope="session")
def byte_level_tokenizer(byte_level_dir) -> tokenizers.Tokenizer:
    """The ``tokenizers`` reference for ``byte_level_dir``."""
    return tokenizers.Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
