"""ggml's integer block types as :class:`~llm_jax.quantization.QuantizedArray` leaves, value for value.

Every block type below stores, per block of consecutive inputs along a row (an output), integers and a
scale (and for some an offset) per sub-block, so that a value is ``s · q`` or ``s · q + o``: exactly one
of our quantization schemes (``llm_jax.config.QuantScheme``), its groups the sub-blocks. The scales are
a float16 times a small integer (K-quants: the super-block's ``d`` times a sub-block's 4- or 6-bit scale),
exact in float32, and the values our leaves stand for are the ``gguf`` package's dequantization's.

=======  ===========================================  =========================================
type     one value, as ggml defines it                 our scheme (bits, group size, offsets)
=======  ===========================================  =========================================
Q8_0     d · q, q int8                                 8, 32
Q4_0     d · (u - 8), u 4 bits                         4, 32
Q4_1     d · u + m                                     4, 32, offsets (u unsigned)
Q5_0     d · (u - 16), u 5 bits                        8, 32
Q5_1     d · u + m                                     8, 32, offsets
Q2_K     d·sc_j · u - dmin·m_j, u 2 bits, j of 16      4, 16, offsets
Q3_K     d·(sc_j - 32) · q, q 3 bits signed, j of 16   4, 16
Q4_K     d·sc_j · u - dmin·m_j, u 4 bits, j of 8       4, 32, offsets
Q5_K     d·sc_j · u - dmin·m_j, u 5 bits, j of 8       8, 32, offsets
Q6_K     d·sc_j · (u - 32), u 6 bits, j of 16          8, 16
IQ4_NL   d · kvalues[u], u 4 bits                      8, 32
IQ4_XS   d·(sc_j - 32) · kvalues[u], j of 8            8, 32
IQ2_XXS  d·(1/2 + sc_j)/4 · ±grid, j of 8              8, 32
IQ2_XS   d·(1/2 + sc_j)/4 · ±grid, j of 16             8, 16
IQ2_S    d·(1/2 + sc_j)/4 · ±grid, j of 16             8, 16
IQ3_XXS  d·(1/2 + sc_j)/2 · ±grid, j of 8              8, 32
IQ3_S    d·(1 + 2 sc_j) · ±grid, j of 8                8, 32
IQ1_S    d·(1 + 2 sc_j) · (grid ± 1/8), j of 8         8, 32 (the scale over 8, q = 8·grid ± 1)
IQ1_M    d·(1 + 2 sc_j) · (grid ± 1/8), j of 16        8, 16 (likewise)
=======  ===========================================  =========================================

``kvalues`` is ggml's table of 16 non-uniform levels (-127 ... 113), read from the ``gguf`` package. The
grids of the 2- and 3-bit i-quants hold small integers (at most 62), chosen by indices and signed by
sign bits in ways that differ from type to type: their integers are read back from the ``gguf`` package's
own dequantization, each value divided by its sub-block's scale (a float16 times a 5-bit number, so the
value, a product of at most 22 significant bits, is exact in float32 and the quotient an integer). IQ1_S
and IQ1_M shift their grids of -1, 0, 1 by ±1/8: over a scale of an eighth the integers are 8·grid ± 1.

The layouts of the bits inside each block are ggml's (``ggml-common.h``); :func:`decode` unpacks them.
A projection whose layers are stored in different types (llama.cpp's Q4_K_M gives some layers of
``attn_v`` and ``ffn_down`` Q6_K, the rest Q4_K) is held in the narrowest scheme that holds every layer
exactly (:func:`common_scheme`, :func:`widen`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llm_jax.config import QuantScheme

SUPER = 256  # values per K-quant super-block

SCHEMES: dict[str, QuantScheme] = {
    "Q8_0": QuantScheme(bits=8, group_size=32),
    "Q4_0": QuantScheme(bits=4, group_size=32),
    "Q4_1": QuantScheme(bits=4, group_size=32, offsets=True),
    "Q5_0": QuantScheme(bits=8, group_size=32),
    "Q5_1": QuantScheme(bits=8, group_size=32, offsets=True),
    "Q2_K": QuantScheme(bits=4, group_size=16, offsets=True),
    "Q3_K": QuantScheme(bits=4, group_size=16),
    "Q4_K": QuantScheme(bits=4, group_size=32, offsets=True),
    "Q5_K": QuantScheme(bits=8, group_size=32, offsets=True),
    "Q6_K": QuantScheme(bits=8, group_size=16),
    "IQ4_NL": QuantScheme(bits=8, group_size=32),
    "IQ4_XS": QuantScheme(bits=8, group_size=32),
    "IQ2_XXS": QuantScheme(bits=8, group_size=32),
    "IQ2_XS": QuantScheme(bits=8, group_size=16),
    "IQ2_S": QuantScheme(bits=8, group_size=16),
    "IQ3_XXS": QuantScheme(bits=8, group_size=32),
    "IQ3_S": QuantScheme(bits=8, group_size=32),
    "IQ1_S": QuantScheme(bits=8, group_size=32),
    "IQ1_M": QuantScheme(bits=8, group_size=16),
}
TYPES = tuple(SCHEMES)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Rows of a block-quantized matrix [R, K] in one of our schemes: ``q`` int8 [R, K] (4 bits: -8 ... 7,
    or 0 ... 15 with offsets), ``s`` float32 [R, K / g], ``o`` float32 [R, K / g] or None."""

    q: np.ndarray
    s: np.ndarray
    o: np.ndarray | None
    scheme: QuantScheme

    def values(self) -> np.ndarray:
        """The float32 values [R, K] they stand for (``s · q`` or ``s · q + o``, in float32)."""
        R, K = self.q.shape
        g = self.scheme.group_size
        w = self.q.reshape(R, K // g, g).astype(np.float32) * self.s[..., None]
        if self.o is not None:
            w = w + self.o[..., None]
        return w.reshape(R, K)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] (little-endian float16) → float32 [...]."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] → [..., 2, n]: low nibbles, then high ones (ggml's order within a block)."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _bits(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    """Bytes [..., n] → [..., count, n]: field i of each byte is bits [width·i, width·(i + 1))."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(count, 1)
    return (packed[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of scales → (scale, min) [n, 8], 6 bits each: sub-blocks 0-3 in the low 6 bits
    of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, topped by bytes 0-7's high 2 bits."""
    a, b, c = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    scale = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    low = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), low.astype(np.float32)


def decode(type_name: str, raw: np.ndarray, K: int) -> Blocks:
    """Rows ``raw`` uint8 [R, bytes per row] of a ``type_name`` matrix with rows of ``K`` values, as
    :class:`Blocks` in the type's scheme (``SCHEMES``)."""
    import gguf

    per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    R = raw.shape[0]
    n = R * (K // per_block)
    b = np.ascontiguousarray(raw).reshape(n, block_bytes)
    scheme = SCHEMES[type_name]
    o = None
    match type_name:
        case "Q8_0":
            s, q = _f16(b[:, 0:2])[:, None], b[:, 2:].view(np.int8)
        case "Q4_0":
            s, q = _f16(b[:, 0:2])[:, None], _nibbles(b[:, 2:]).reshape(n, 32).astype(np.int8) - 8
        case "Q4_1":
            s, o, q = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None], _nibbles(b[:, 4:]).reshape(n, 32)
        case "Q5_0" | "Q5_1":
            start = 2 if type_name == "Q5_0" else 4
            high = np.unpackbits(b[:, start:start + 4], axis=-1, bitorder="little")  # bit j: value j's 5th bit
            u = _nibbles(b[:, start + 4:]).reshape(n, 32) | (high << 4)
            s = _f16(b[:, 0:2])[:, None]
            if type_name == "Q5_0":
                q = u.astype(np.int8) - 16
            else:
                o, q = _f16(b[:, 2:4])[:, None], u
        case "Q2_K":  # scales [16] (low nibble sc, high m), qs [64], d, dmin
            sc, qs = b[:, 0:16], b[:, 16:80]
            d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
            q = _bits(qs.reshape(n, 2, 32), 4, 2).reshape(n, SUPER)  # 2 × 4 fields × 32: values in order
            s, o = d * (sc & 0x0F).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))
        case "Q3_K":  # hmask [32], qs [64], scales [12], d
            hmask, qs, packed, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])[:, None]
            low = _bits(qs.reshape(n, 2, 32), 4, 2).reshape(n, SUPER)
            high = _bits(hmask, 8, 1).reshape(n, SUPER)  # a set bit means no offset of -4
            q = low.astype(np.int8) - 4 * (1 - high.astype(np.int8))
            sc = (_nibbles(packed[:, 0:8]).reshape(n, 16) | (_bits(packed[:, 8:12], 4, 2).reshape(n, 16) << 4))
            s = d * (sc.astype(np.float32) - 32)
        case "Q4_K" | "Q5_K":  # d, dmin, scales [12], (Q5_K: qh [32]), qs [128]
            d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
            sc, mins = _k_scales(b[:, 4:16])
            start = 16 if type_name == "Q4_K" else 48
            u = _nibbles(b[:, start:].reshape(n, 4, 32)).reshape(n, SUPER)  # 4 × (low 32, high 32)
            if type_name == "Q5_K":
                u = u | (_bits(b[:, 16:48], 8, 1).reshape(n, SUPER) << 4)
            s, o, q = d * sc, -(dmin * mins), u
        case "Q6_K":  # ql [128], qh [64], scales [16] int8, d
            ql, qh = b[:, 0:128], b[:, 128:192]
            low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 2, 4, 32)  # half, (low | high) × 64 → 4 × 32
            high = _bits(qh.reshape(n, 2, 32), 4, 2)  # half, 4 fields × 32
            q = (low | (high << 4)).reshape(n, SUPER).astype(np.int8) - 32
            s = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
        case "IQ4_NL" | "IQ4_XS":
            levels = np.asarray(gguf.quants.IQ4_NL.kvalues, np.int8)
            if type_name == "IQ4_NL":  # d, qs [16]
                s, u = _f16(b[:, 0:2])[:, None], _nibbles(b[:, 2:]).reshape(n, 32)
            else:  # d, scales_h (uint16: 2 high bits per sub-block), scales_l [4] (a nibble each), qs [128]
                high = np.ascontiguousarray(b[:, 2:4]).view("<u2")[:, 0:1] >> (2 * np.arange(8, dtype=np.uint16))
                sc = _nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(n, 8) | ((high & 3).astype(np.uint8) << 4)
                s = _f16(b[:, 0:2])[:, None] * (sc.astype(np.float32) - 32)
                u = _nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, SUPER)  # 8 × (low 16, high 16)
            q = levels[u]
        case "IQ2_XXS" | "IQ2_XS" | "IQ2_S" | "IQ3_XXS" | "IQ3_S" | "IQ1_S" | "IQ1_M":
            s = _grid_scales(type_name, b)
            values = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[type_name]).reshape(*s.shape, -1)
            q = np.rint(values / np.where(s == 0, 1, s)[..., None]) * (s != 0)[..., None]
        case _:
            raise ValueError(f"ggml type {type_name} is not one of {TYPES}")
    G = K // scheme.group_size
    return Blocks(np.asarray(q, np.int8).reshape(R, K), np.asarray(s, np.float32).reshape(R, G),
                  None if o is None else np.asarray(o, np.float32).reshape(R, G), scheme)


def _grid_scales(type_name: str, b: np.ndarray) -> np.ndarray:
    """The 1- to 3-bit i-quants' sub-block scales: float32 [n, sub-blocks per 256]."""
    def words(start: int, stop: int) -> np.ndarray:  # little-endian uint32s
        return np.ascontiguousarray(b[:, start:stop]).view("<u4")

    def nibbles(start: int, stop: int) -> np.ndarray:  # low then high nibble of each byte, in byte order
        return _nibbles(b[:, start:stop]).transpose(0, 2, 1).reshape(len(b), -1).astype(np.float32)

    def halves(start: int, stop: int) -> np.ndarray:  # little-endian uint16s
        return np.ascontiguousarray(b[:, start:stop]).view("<u2")

    d = _f16(b[:, 0:2])[:, None]
    match type_name:
        case "IQ2_XXS":  # d, qs: 8 pairs of uint32, the second's top 4 bits the scale
            return d * ((0.5 + (words(2, 66)[:, 1::2] >> 28).astype(np.float32)) * 0.25)
        case "IQ2_XS":  # d, qs [64], scales [8]
            return d * ((0.5 + nibbles(66, 74)) * 0.25)
        case "IQ2_S":  # d, qs [32], signs [32], qh [8], scales [8]
            return d * ((0.5 + nibbles(74, 82)) * 0.25)
        case "IQ3_XXS":  # d, qs [64], then 8 uint32 of signs topped by the scale
            return d * ((0.5 + (words(66, 98) >> 28).astype(np.float32)) * 0.5)
        case "IQ3_S":  # d, qs [64], qh [8], signs [32], scales [4]
            return d * (1 + 2 * nibbles(106, 110))
        case "IQ1_S":  # d, qs [32], qh: 8 uint16, bits 12-14 the scale
            return d * (2 * ((halves(34, 50) >> 12) & 7).astype(np.float32) + 1) / 8
        case "IQ1_M":  # qs [32], qh [16], 4 uint16: 3-bit scales in bits 0-11, d's 16 bits in the top nibbles
            w = halves(48, 56)
            d_bits = (w[:, 0] >> 12) | ((w[:, 1] >> 12) << 4) | ((w[:, 2] >> 12) << 8) | ((w[:, 3] >> 12) << 12)
            d = d_bits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
            sc = (w[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7  # word i, field j: scale 4i + j
            return d * (2 * sc.reshape(len(b), 16).astype(np.float32) + 1) / 8
    raise ValueError(type_name)


def common_scheme(schemes) -> QuantScheme:
    """The narrowest scheme that holds each of ``schemes`` exactly: the most bits, the smallest group (the
    group sizes divide one another), offsets if any has them."""
    schemes = list(schemes)
    groups = {s.group_size for s in schemes}
    g = min(groups)
    if any(x % g for x in groups):
        raise ValueError(f"group sizes {sorted(groups)} do not divide one another")
    return QuantScheme(bits=max(s.bits for s in schemes), group_size=g, offsets=any(s.offsets for s in schemes))


def widen(blocks: Blocks, scheme: QuantScheme) -> Blocks:
    """``blocks`` in ``scheme`` (one :func:`common_scheme` gives), standing for the same values exactly:
    groups split (scales and offsets repeated), offsets added (4 bits: ``u = q + 8`` with ``o = -8 s``,
    a product by a power of two; 8 bits: ``o = 0``), 4-bit integers held in 8."""
    q, s, o, old = blocks.q, blocks.s, blocks.o, blocks.scheme
    if old.group_size % scheme.group_size or old.bits > scheme.bits or (old.offsets and not scheme.offsets):
        raise ValueError(f"{old} does not widen to {scheme}")
    if scheme.offsets and o is None:
        if old.bits == 4:
            q, o = q + 8, -8 * s
        else:
            o = np.zeros_like(s)
    split = old.group_size // scheme.group_size
    if split > 1:
        s, o = np.repeat(s, split, axis=-1), None if o is None else np.repeat(o, split, axis=-1)
    return Blocks(q, s, o, scheme)


def leaf_arrays(blocks: Blocks, *, transposed: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The rows [R = outputs, K = inputs] as a :class:`QuantizedArray`'s (values, scales, offsets) of a
    [K, R] weight: int8 [K, R] or packed uint8 [K / 2, R] (input 2j low nibble, 2j + 1 high, each stored
    as ``q + 8``, or ``q`` itself with offsets), and float32 [K / g, R]. ``transposed``: of a ``transposed``
    leaf, the rows as they are ([R, K] or [R, K / 2], and [R, K / g]; an embedding table's rows)."""
    q = blocks.q
    if blocks.scheme.bits == 4:
        u = (q if blocks.scheme.offsets else q + 8).astype(np.uint8)
        values = u[:, 0::2] | (u[:, 1::2] << 4)
    else:
        values = q
    arrays = (values, blocks.s, blocks.o)
    return tuple(None if a is None else np.ascontiguousarray(a if transposed else a.T) for a in arrays)


def bits_per_value(scheme: QuantScheme, K: int) -> float:
    """Bytes a leaf of this scheme holds per value, in bits (integers, scales and offsets)."""
    groups = math.ceil(K / scheme.group_size)
    return scheme.bits + 32 * groups * (2 if scheme.offsets else 1) / K
