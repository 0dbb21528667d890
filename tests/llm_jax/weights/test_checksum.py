"""Tensor checksums: host (numpy), device program and per-shard sums agree bit for bit, and catch changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.weights.checksum import _MASK, _host_sum, _unsigned, checksums, device_partial_sums, host_checksum

SHAPES = [(), (7,), (3, 5), (2, 3, 4), (5, 1000, 1000)]  # the last spans several host chunks and device blocks


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(0)
    return {(dtype, shape): rng.standard_normal(shape).astype(dtype)
            for dtype in ("float32", "bfloat16", "float16") for shape in SHAPES}


def test_host_device_and_cpu_paths_agree(tensors):
    host = {key: host_checksum(x) for key, x in tensors.items()}
    assert checksums({key: jnp.asarray(x) for key, x in tensors.items()}) == host  # CPU shards: numpy views
    program = device_partial_sums(jax.devices()[0], [(jnp.asarray(x), (0,) * x.ndim, x.shape)
                                                     for x in tensors.values()])
    assert dict(zip(tensors, program)) == host  # the program accelerators run
    assert checksums(tensors) == host  # numpy leaves


def test_shards_add_up_to_the_whole(tensors):
    """Blocks at their offsets in the global array sum to the whole tensor's checksum (mod 2^32)."""
    x = tensors[("bfloat16", (2, 3, 4))]
    blocks = [(x[:, :, :1], (0, 0, 0)), (x[:, :, 1:], (0, 0, 1))]
    bits = [(b.view(_unsigned(b.dtype)), starts) for b, starts in blocks]
    assert sum(_host_sum(np.ascontiguousarray(b), s, x.shape) for b, s in bits) & _MASK == host_checksum(x)
    program = device_partial_sums(jax.devices()[0], [(jnp.asarray(b), s, x.shape) for b, s in blocks])
    assert sum(program) & _MASK == host_checksum(x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_any_single_bit_flip_and_moved_values_change_it(tensors, dtype):
    x = tensors[(dtype, (2, 3, 4))]
    reference = host_checksum(x)
    for element in range(x.size):
        for bit in range(x.dtype.itemsize * 8):
            flipped = x.copy()
            flipped.reshape(-1).view(_unsigned(x.dtype))[element] ^= 1 << bit
            assert host_checksum(flipped) != reference, (element, bit)
    assert host_checksum(x[::-1].copy()) != reference
    assert host_checksum(np.swapaxes(x, 1, 2).copy().reshape(x.shape)) != reference
