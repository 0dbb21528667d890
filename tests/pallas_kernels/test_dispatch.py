"""Variant choice by backend, and the public entry points end to end (interpreted on the CPU)."""

import jax
import pytest

from attention_testing import (
    DISPATCH_INTERPRET, Case, assert_matches_reference, decode_inputs, prefill_inputs,
)
from pallas_kernels import Platform, decode_attention, dispatch, flash_attention, reference


@pytest.mark.parametrize("backend,platform,interpret,expected", [
    ("gpu", None, None, (Platform.GPU, False)),
    ("tpu", None, None, (Platform.TPU, False)),
    ("cpu", None, None, (Platform.GPU, True)),
    ("cpu", Platform.TPU, None, (Platform.TPU, True)),
    ("gpu", Platform.TPU, None, (Platform.TPU, True)),
    ("gpu", None, True, (Platform.GPU, True)),
    ("tpu", None, True, (Platform.TPU, True)),
])
def test_chooses_the_variant_for_the_backend(monkeypatch, backend, platform, interpret, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert dispatch.choose_variant(platform, interpret) == expected


def test_refuses_to_compile_for_a_foreign_backend(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(ValueError, match="cannot be compiled for the 'cpu' backend"):
        dispatch.choose_variant(None, False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="the tpu kernels cannot be compiled for the 'gpu'"):
        dispatch.choose_variant(Platform.TPU, False)
    with pytest.raises(ValueError, match="platform must be one of"):
        dispatch.choose_variant("gpu", None)


@pytest.mark.parametrize("platform", [None, Platform.TPU])
def test_flash_attention_entry_point(platform):
    case = Case(B=2, T=24, S=24, N=4, K=2, H=16, lengths=(24, 9), sliding_window=10)
    q, k, v, lengths = prefill_inputs(case)
    out = flash_attention(q, k, v, lengths, **case.options, platform=platform,
                          interpret=DISPATCH_INTERPRET)
    assert_matches_reference(out, reference.attention_reference(q, k, v, lengths, **case.options))


@pytest.mark.parametrize("platform", [None, Platform.TPU])
def test_decode_attention_entry_point(platform):
    case = Case(B=2, S=40, N=4, K=2, H=16, lengths=(40, 9), logit_softcap=20.0)
    q, k, v, lengths = decode_inputs(case)
    out = decode_attention(q, k, v, lengths, **case.options, num_splits=2, platform=platform,
                           interpret=DISPATCH_INTERPRET)
    assert_matches_reference(
        out, reference.decode_attention_reference(q, k, v, lengths, **case.options))
