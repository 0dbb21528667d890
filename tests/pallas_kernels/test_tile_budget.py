"""Default tiles fit the memory of every device they may run on: shared memory per program on each
GPU of ``gpu_tiles.SMEM_PER_BLOCK_BYTES``, the default scoped VMEM on TPU."""

import dataclasses
import types

import jax.numpy as jnp
import pytest

from pallas_kernels import decode_attention_gpu, flash_attention_gpu, gpu_tiles, shapes, tpu_tiles
from pallas_kernels import decode_attention_tpu, flash_attention_tpu

HEAD_DIMS = (64, 80, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")
BUDGETS = sorted(set(gpu_tiles.SMEM_PER_BLOCK_BYTES.values()))


@pytest.fixture
def budget(request, monkeypatch):
    """The device's shared memory, as ``gpu_tiles.smem_budget`` would read it."""
    monkeypatch.setattr(gpu_tiles, "smem_budget", lambda device=None: gpu_tiles.SmemBudget(
        bytes=request.param, source="test"))
    return request.param


def _is_tile(size: int) -> bool:
    return size >= 16 and size & (size - 1) == 0


@pytest.mark.parametrize("budget", BUDGETS, indirect=True, ids=lambda b: f"{b // 1024}KiB")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HEAD_DIMS)
def test_default_gpu_tiles_fit_shared_memory(budget, dtype, H):
    prefill = shapes.AttentionDims(B=1, T=8192, S=8192, N=32, K=8, H=H)
    tiles = [flash_attention_gpu.choose_tiles(prefill, dtype, block_q=None, block_k=None,
                                              num_stages=None)]
    for G in (1, 2, 4, 7, 8, 16, 32):
        decode = shapes.AttentionDims(B=1, T=1, S=32768, N=G * 4, K=4, H=H)
        tiles.append(decode_attention_gpu.choose_tiles(decode, dtype, block_k=None,
                                                       num_stages=None))
    for t in tiles:
        assert gpu_tiles.smem_bytes(t, dtype) <= budget, t
        assert t.head_dim == gpu_tiles.tile_size(H) and t.num_stages >= 1, t
        assert _is_tile(t.block_q) and _is_tile(t.block_k), t


def test_shared_memory_of_a_tile_choice():
    """q tile + num_stages x (K and V tiles) + the p tile, in the input dtype."""
    tiles = gpu_tiles.Tiles(block_q=64, block_k=32, head_dim=128, num_stages=3)
    assert gpu_tiles.smem_bytes(tiles, jnp.bfloat16) == 2 * (64 * 128 + 6 * 32 * 128 + 64 * 32)
    assert gpu_tiles.smem_bytes(tiles, jnp.float32) == 2 * gpu_tiles.smem_bytes(tiles, "bfloat16")


H100 = gpu_tiles.SMEM_PER_BLOCK_BYTES["9.0"]


@pytest.mark.parametrize("budget", [H100], indirect=True)
def test_float32_head_dim_256_drops_the_third_stage_on_h100(budget):
    """The old fixed default (64 x 32, three stages) needed 264 KiB; the largest fitting choice
    keeps the blocks and drops a stage."""
    dims = shapes.AttentionDims(B=1, T=4096, S=4096, N=8, K=8, H=256)
    old = gpu_tiles.Tiles(block_q=64, block_k=32, head_dim=256, num_stages=3)
    assert gpu_tiles.smem_bytes(old, jnp.float32) > H100
    tiles = flash_attention_gpu.choose_tiles(dims, jnp.float32, block_q=None, block_k=None,
                                             num_stages=None)
    assert tiles == dataclasses.replace(old, num_stages=2)


@pytest.mark.parametrize("budget", [H100], indirect=True)
def test_tiles_that_fit_are_kept(budget):
    """bfloat16, H = 128 on an H100: the preferred 128 x 64 tiles with three stages (144 KiB)."""
    dims = shapes.AttentionDims(B=1, T=4096, S=4096, N=32, K=8, H=128)
    tiles = flash_attention_gpu.choose_tiles(dims, jnp.bfloat16, block_q=None, block_k=None,
                                             num_stages=None)
    assert tiles == gpu_tiles.Tiles(block_q=128, block_k=64, head_dim=128, num_stages=3)


def test_fit_shrinks_stages_then_keys_then_queries_but_never_fixed_fields():
    def tiles(block_q, block_k, num_stages):
        return gpu_tiles.Tiles(block_q=block_q, block_k=block_k, head_dim=256,
                               num_stages=num_stages)

    def fit(budget_tiles, **kwargs):
        budget = gpu_tiles.smem_bytes(budget_tiles, jnp.float16)
        return gpu_tiles.fit_tiles(tiles(128, 128, 4), dtype=jnp.float16, budget_bytes=budget,
                                   **kwargs)

    assert fit(tiles(128, 32, 2)) == tiles(128, 32, 2)
    assert fit(tiles(32, 128, 2), fixed={"block_k"}) == tiles(32, 128, 2)
    assert fit(tiles(128, 16, 1)) == tiles(64, 16, 2)  # block_q goes before the second stage
    with pytest.raises(ValueError, match=r"block_q=128 block_k=128 Hp=256 num_stages=4 need "
                                         r"\d+ bytes of shared memory for float16"):
        fit(tiles(128, 32, 2), fixed={"block_q", "block_k", "num_stages"})


@pytest.mark.parametrize("budget", [min(BUDGETS)], indirect=True)
def test_explicit_tiles_that_cannot_fit_are_refused(budget):
    dims = shapes.AttentionDims(B=1, T=4096, S=4096, N=8, K=8, H=256)
    with pytest.raises(ValueError, match="more than the 101376 a program may use"):
        flash_attention_gpu.choose_tiles(dims, jnp.float32, block_q=128, block_k=128,
                                         num_stages=3)


def test_budget_from_the_device_then_the_table_then_the_smallest():
    reporting = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                      shared_memory_per_block_optin=232448,
                                      compute_capability="9.0")
    assert gpu_tiles.smem_budget(reporting).bytes == 232448
    silent = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                                   compute_capability="8.0")
    assert gpu_tiles.smem_budget(silent).bytes == 163 * 1024
    assert "8.0" in gpu_tiles.smem_budget(silent).source
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    assert gpu_tiles.smem_budget(cpu).bytes == min(BUDGETS) == 99 * 1024


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HEAD_DIMS)
def test_default_tpu_tiles_fit_scoped_vmem(dtype, H):
    prefill = flash_attention_tpu.vmem_bytes(block_q=128, block_k=256, head_dim=H, dtype=dtype)
    assert prefill <= tpu_tiles.SCOPED_VMEM_BYTES
    for G in (1, 2, 4, 7, 8, 16, 32):
        decode = decode_attention_tpu.vmem_bytes(group=G, block_k=512, head_dim=H, dtype=dtype)
        assert decode <= tpu_tiles.SCOPED_VMEM_BYTES


def test_vmem_pads_to_mosaic_tiles_and_double_buffers_blocks():
    # [3, 80] bfloat16 pads to [16, 128]; [3, 80] float32 to [8, 128]
    assert tpu_tiles.vmem_bytes(blocks=[((3, 80), jnp.bfloat16)], scratch=[]) == 2 * 16 * 128 * 2
    assert tpu_tiles.vmem_bytes(blocks=[], scratch=[((3, 80), jnp.float32)]) == 8 * 128 * 4


def test_tpu_blocks_past_scoped_vmem_are_refused():
    with pytest.raises(ValueError, match=r"decode_attention_tpu tiles block_k=16384 need \d+ "
                                         r"bytes of VMEM"):
        tpu_tiles.check_vmem("decode_attention_tpu", decode_attention_tpu.vmem_bytes(
            group=8, block_k=16384, head_dim=256, dtype=jnp.float32), block_k=16384)
