"""Embeddings against ``transformers``' base model (``AutoModel``: the final hidden states after the final
norm), last-token and mean pooling, in batches of texts of different lengths (float32, ≤ 1e-5)."""

import numpy as np
import pytest
import torch
import transformers

import llm_jax

TEXTS = [[1], [1, 45, 300, 12, 7], [1, *range(20, 37)], [1, *range(100, 139)], "Once upon a time, a cat",
         [1, 9, 9, 9]]


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    model = transformers.AutoModel.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    return model, tokenizer


def reference_embeddings(reference, texts, pooling: str) -> np.ndarray:
    model, tokenizer = reference
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        vector = hidden[-1] if pooling == "last" else hidden.mean(0)
        out.append(vector / np.linalg.norm(vector))
    return np.stack(out)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_hidden_states(stories260k_dir, reference, pooling):
    model = llm_jax.load(stories260k_dir / "hf")
    ours = llm_jax.embed_texts(model, TEXTS, pooling=pooling, batch_size=4)  # two batches, padded rows
    np.testing.assert_allclose(ours, reference_embeddings(reference, TEXTS, pooling), atol=1e-5)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), model.config.d_model)
    raw = llm_jax.embed_texts(model, TEXTS[:2], pooling=pooling, normalize=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), ours[:2], atol=1e-6)
    short = llm_jax.embed_texts(model, TEXTS, pooling=pooling, dimensions=16)
    np.testing.assert_allclose(short, ours[:, :16] / np.linalg.norm(ours[:, :16], axis=1, keepdims=True), atol=1e-6)


def test_bad_arguments_are_refused(stories):
    with pytest.raises(ValueError, match="pooling"):
        llm_jax.embed_texts(stories, ["a"], pooling="max")
    with pytest.raises(ValueError, match="dimensions"):
        llm_jax.embed_texts(stories, ["a"], dimensions=stories.config.d_model + 1)
    with pytest.raises(ValueError, match="no tokens"):
        llm_jax.embed_texts(stories, [[]])
    with pytest.raises(ValueError, match="context"):
        llm_jax.embed_texts(stories, [[1] * (stories.config.max_seq_len + 1)])
