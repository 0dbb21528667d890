"""``scripts/convert.py``: a Hugging Face folder, llama2.c ``.bin`` or GGUF file → an llm_jax checkpoint folder."""

from __future__ import annotations

import argparse
import sys

from llm_jax.cli.common import CliParser, positive_int, run_main


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        description="Convert a Hugging Face model folder, a llama2.c .bin or a GGUF file into an llm_jax checkpoint.")
    p.add_argument("source", help="Hugging Face folder (config.json + *.safetensors), llama2.c .bin or .gguf")
    p.add_argument("dest", help="checkpoint folder to create, e.g. checkpoints/llama-3.2-1b")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                   help="stored dtype (default: the source's own; float32 for llama2.c)")
    p.add_argument("--quantize", choices=["int8", "int4", "int4-asym"], default=None,
                   help="store the projections as integers: int8 per output channel, int4 in groups of --group-size "
                        "(int4-asym: with an offset per group as well, as llama.cpp's Q4_1)")
    p.add_argument("--group-size", type=positive_int, default=None, metavar="G",
                   help="inputs sharing one scale (default: int8 per output channel, int4 32)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="with --quantize, the embedding table and LM head too (int8 per row)")
    p.add_argument("--dequantize", action="store_true",
                   help="a GGUF's Q8_0 / Q4_0 projections stored as floats (default: as int8 / int4 as they are)")
    p.add_argument("--force", action="store_true", help="replace dest if it is an llm_jax checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


class _Bars:
    """One tqdm bar per stage (reading source tensors, then saving ours), advanced per tensor."""

    def __init__(self):
        self.bar = None
        self.stage = None

    def __call__(self, event) -> None:
        from tqdm import tqdm

        if event.stage != self.stage:
            self.close()
            self.stage = event.stage
            self.bar = tqdm(total=event.total, desc=event.stage, unit="tensor", file=sys.stderr, leave=True)
        self.bar.set_postfix_str(event.tensor, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quantize is None and (args.group_size is not None or args.quantize_embedding):
        parser.error("--group-size and --quantize-embedding need --quantize")
    # Imported here so --help answers without starting JAX.
    from llm_jax.quantization import parse_quantization
    from llm_jax.weights.convert import convert

    quantize = None
    if args.quantize is not None:
        try:
            quantize = parse_quantization(args.quantize, args.group_size, embedding=args.quantize_embedding)
        except ValueError as e:
            parser.error(str(e))
    bars = None if args.quiet else _Bars()
    try:
        dest = convert(args.source, args.dest, dtype=args.dtype, force=args.force, quantize=quantize,
                       dequantize=args.dequantize, progress=bars)
    finally:
        if bars is not None:
            bars.close()
    print(f"wrote {dest}", file=sys.stderr)
    return 0


def entry() -> int:
    return run_main(main)
