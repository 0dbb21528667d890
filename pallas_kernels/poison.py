"""Proof that a kernel writes every output element: start its output buffers as NaN.

A ``pallas_call`` output starts with undefined contents, and an element the kernel never writes
keeps them. With ``poison_output=True`` a wrapper passes NaN-filled buffers aliased to its outputs
(``input_output_aliases``), so an unwritten element reads back as NaN. Tests turn it on; it costs a
fill of each output, so it is off by default.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def alias_nan_outputs(
    kernel: Callable, args: Sequence, in_specs: Sequence[pl.BlockSpec],
    out_shapes: Sequence[jax.ShapeDtypeStruct], out_specs: Sequence[pl.BlockSpec],
) -> tuple[Callable, list, list[pl.BlockSpec], dict[int, int]]:
    """(kernel, args, in_specs, input_output_aliases) with one NaN buffer per output appended to the
    inputs and aliased to that output.

    ``args`` are all the pallas_call operands (scalar-prefetch ones first); the kernel gets the
    poison buffers' input refs right after the real inputs' and never reads them, so the returned
    kernel drops them before calling the original.
    """
    first_ref, count = len(args), len(out_shapes)

    def kernel_without_poison_refs(*refs):
        return kernel(*refs[:first_ref], *refs[first_ref + count:])

    nan_buffers = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shapes]
    aliases = {first_ref + i: i for i in range(count)}
    return (kernel_without_poison_refs, [*args, *nan_buffers], [*in_specs, *out_specs], aliases)
