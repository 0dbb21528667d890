import itertools

import numpy as np
import pytest
import sentencepiece

from training import data
from training.stories import stories


@pytest.fixture(scope="module")
def processor() -> sentencepiece.SentencePieceProcessor:
    model = data.train_tokenizer(itertools.islice(stories(0), 300), vocab_size=512)
    return sentencepiece.SentencePieceProcessor(model_proto=model)


def test_tokenizer_training_is_deterministic_and_byte_identical():
    texts = list(itertools.islice(stories(5), 200))
    assert data.train_tokenizer(texts, vocab_size=400) == data.train_tokenizer(iter(texts), vocab_size=400)


def test_tokenizer_special_ids_and_round_trip(processor):
    assert processor.vocab_size() == 512
    assert (processor.unk_id(), processor.bos_id(), processor.eos_id(), processor.pad_id()) == (
        data.UNK_ID, data.BOS_ID, data.EOS_ID, -1)
    for text in itertools.islice(stories(9), 50):
        assert processor.decode(processor.encode(text)) == text
    # Byte fallback: text the stories never contain still encodes, without UNK.
    odd = "Grüße, 東京! ~ 42"
    ids = processor.encode(odd)
    assert data.UNK_ID not in ids and processor.decode(ids) == odd


def test_encode_documents_wraps_each_in_bos_and_eos(processor):
    docs = list(data.encode_documents(processor, ["Tom ran.", "Mia sat."]))
    assert [d[0] for d in docs] == [data.BOS_ID] * 2 and [d[-1] for d in docs] == [data.EOS_ID] * 2
    assert docs[0][1:-1] == processor.encode("Tom ran.")


def test_pad_rows_puts_one_document_per_row_and_splits_long_ones():
    docs = [[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 11, 12, 2]]
    rows = data.pad_rows(docs, row_len=5)
    assert rows.tokens_RT.shape == (4, 5) and rows.tokens_RT.dtype == np.int32
    np.testing.assert_array_equal(rows.lengths_R, [4, 3, 5, 2])
    np.testing.assert_array_equal(rows.tokens_RT, [[1, 5, 6, 2, 0], [1, 7, 2, 0, 0], [1, 8, 9, 10, 11],
                                                   [12, 2, 0, 0, 0]])
    assert rows.num_tokens == sum(map(len, docs))


def test_pad_rows_stops_after_num_rows_of_an_endless_stream():
    endless = ([1, i, 2] for i in itertools.count(10))
    rows = data.pad_rows(endless, row_len=4, num_rows=3)
    np.testing.assert_array_equal(rows.tokens_RT, [[1, 10, 2, 0], [1, 11, 2, 0], [1, 12, 2, 0]])
    np.testing.assert_array_equal(rows.lengths_R, [3, 3, 3])


def test_pad_rows_errors():
    with pytest.raises(ValueError, match="ran out after 2 of 3 rows"):
        data.pad_rows([[1, 2, 3], [4, 5, 6]], row_len=4, num_rows=3)
    with pytest.raises(ValueError, match="row_len=1"):
        data.pad_rows([[1, 2]], row_len=1)


def test_batches_are_consecutive_and_drop_a_partial_batch():
    rows = data.pad_rows([list(range(1, 22))], row_len=3)  # 7 rows
    got = list(data.batches(rows, batch_size=3))
    assert len(got) == 2
    np.testing.assert_array_equal(got[1][0], rows.tokens_RT[3:6])
    np.testing.assert_array_equal(got[1][1], rows.lengths_R[3:6])
