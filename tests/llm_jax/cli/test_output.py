"""What the generate CLI prints: streaming order and flushing, id streams, metrics fields."""

import io
import types

from llm_jax.cli.output import json_report, metrics_fields, print_status, write_stream
from llm_jax.generation import GenerationMetrics, GenerationResult, StreamEvent


class Recorder(io.StringIO):
    """A stdout that logs what the reader could see: text is visible once flushed."""

    def __init__(self, log: list):
        super().__init__()
        self.log, self._flushed = log, 0

    def flush(self):
        super().flush()
        text = self.getvalue()
        if len(text) > self._flushed:
            self.log.append(("shown", text[self._flushed:]))
            self._flushed = len(text)


def events_logged(events, log):
    for i, event in enumerate(events):
        log.append(("pulled", i))
        yield event


def test_single_prompt_streams_each_chunk_before_the_next_is_generated():
    events = [StreamEvent(index=0, token_ids=(5,), text=","), StreamEvent(index=0, token_ids=(6, 7), text=" there"),
              StreamEvent(index=0, token_ids=(8,), text=" was", finish_reason="length")]
    log = []
    out = Recorder(log)
    write_stream(events_logged(events, log), out, echoes=["Once"], with_text=True)
    assert out.getvalue() == "Once, there was\n"
    assert log == [("pulled", 0), ("shown", "Once,"), ("pulled", 1), ("shown", " there"), ("pulled", 2),
                   ("shown", " was\n")]


def test_batch_prints_in_prompt_order_the_first_unfinished_live():
    events = [StreamEvent(index=0, token_ids=(1,), text="a0"), StreamEvent(index=1, token_ids=(1,), text="b0"),
              StreamEvent(index=2, token_ids=(1,), text="c0", finish_reason="stop"),
              StreamEvent(index=1, token_ids=(1,), text="b1"),
              StreamEvent(index=0, token_ids=(1,), text="a1", finish_reason="eos"),
              StreamEvent(index=1, token_ids=(1,), text="b2", finish_reason="length")]
    log = []
    out = Recorder(log)
    write_stream(events_logged(events, log), out, echoes=["A:", "B:", "C:"], with_text=True)
    assert out.getvalue() == "--- 1/3 ---\nA:a0a1\n--- 2/3 ---\nB:b0b1b2\n--- 3/3 ---\nC:c0\n"
    shown = [entry for entry in log if entry[0] == "shown"]
    # Prompt 1 streams live; prompt 2's text waits for prompt 1's end, then streams live; prompt 3 (done
    # early) follows prompt 2.
    assert shown == [("shown", "--- 1/3 ---\nA:a0"), ("shown", "a1\n--- 2/3 ---\nB:b0b1"),
                     ("shown", "b2\n--- 3/3 ---\nC:c0\n")]


def test_a_model_without_tokenizer_streams_ids():
    events = [StreamEvent(index=0, token_ids=(5, 6), text=""), StreamEvent(index=0, token_ids=(), text=""),
              StreamEvent(index=0, token_ids=(7,), text="", finish_reason="length")]
    out = io.StringIO()
    write_stream(events, out, echoes=[""], with_text=False)
    assert out.getvalue() == "5 6 7\n"


METRICS = GenerationMetrics(compile_s=1.25, prefill_s=0.5, ttft_s=0.5, itl_s=0.004, itl_p50_s=0.0031,
                            itl_p90_s=0.0052, decode_s=1.0, decode_tokens_per_s=250.04, prompt_tokens=5,
                            generated_tokens=100)


def test_metrics_line():
    out = io.StringIO()
    print_status(metrics_fields(METRICS), out)
    expected = "[100 tokens · ttft 500 ms · itl p50 3.1 ms p90 5.2 ms · 250.0 tok/s · compile 1.2 s]\n"
    assert out.getvalue() == expected


def test_json_report_has_exactly_the_specified_fields():
    result = GenerationResult(prompt=None, prompt_ids=[1, 2], output_ids=[3], text=None, finish_reason="eos",
                              metrics=METRICS)
    report = json_report("m.bin", types.SimpleNamespace(results=[result], metrics=METRICS))
    assert report == {"model": "m.bin",
                      "results": [{"prompt": None, "prompt_ids": [1, 2], "output_ids": [3], "text": None,
                                   "finish_reason": "eos"}],
                      "metrics": {"compile_s": 1.25, "ttft_s": 0.5, "itl_s": 0.004, "decode_tokens_per_s": 250.04}}
