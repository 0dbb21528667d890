"""The poisoning behind the "every output element is written" checks: an element a kernel does not
write must come back NaN, for a Triton-style grid and for a Mosaic-style one (scalar prefetch,
VMEM scratch, output written on the last step of a sequential axis)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import poison, tpu_tiles

_X = jnp.zeros((16, 128), jnp.float32)
_OUT = jax.ShapeDtypeStruct(_X.shape, _X.dtype)


def test_gpu_style_kernel_leaves_unwritten_blocks_nan():
    def write_first_block(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _write():
            o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    kernel, args, in_specs, aliases = poison.alias_nan_outputs(
        write_first_block, [_X], [spec], [_OUT], [spec])
    out = pl.pallas_call(kernel, grid=(2,), in_specs=in_specs, out_specs=spec, out_shape=_OUT,
                         input_output_aliases=aliases, interpret=True)(*args)
    out = np.asarray(out)
    assert (out[:8] == 1.0).all() and np.isnan(out[8:]).all()


def test_tpu_style_kernel_leaves_unwritten_blocks_nan():
    def write_first_block(flag_ref, x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(1) == 0)
        def _init():
            acc_ref[...] = x_ref[...] + 1.0

        @pl.when((pl.program_id(1) == pl.num_programs(1) - 1) & (pl.program_id(0) == flag_ref[0]))
        def _write():
            o_ref[...] = acc_ref[...]

    spec = pl.BlockSpec((8, 128), lambda i, step, flag_ref: (i, 0))
    kernel, args, in_specs, aliases = poison.alias_nan_outputs(
        write_first_block, [jnp.zeros(1, jnp.int32), _X], [spec], [_OUT], [spec])
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2, 3), in_specs=in_specs, out_specs=spec,
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)]),
        out_shape=_OUT, input_output_aliases=aliases,
        interpret=tpu_tiles.interpreter(True, poison_output=True),
    )(*args)
    out = np.asarray(out)
    assert (out[:8] == 1.0).all() and np.isnan(out[8:]).all()
