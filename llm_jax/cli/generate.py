"""``scripts/generate.py``: generate text from a model on the command line, streaming as it goes."""

from __future__ import annotations

import argparse
import json
import sys

from llm_jax.cli.common import CliError, positive_int, run_main, token_ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text with llm_jax.")
    p.add_argument("--model", required=True,
                   help="llama2.c .bin, Hugging Face folder, or llm_jax checkpoint folder")
    p.add_argument("--prompt", dest="prompts", action="append", default=[],
                   help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=token_ids,
                   help="a prompt as comma-separated token ids, used exactly as given (no BOS added)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--attention", choices=["xla", "pallas"], default="xla")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--mesh", default=None,
                   help="shard over devices: 'data=2,model=4', 'model=8', ... (docs/running_on_many_devices.md)")
    group = p.add_argument_group("several processes (one per host; run the same command on each)")
    group.add_argument("--coordinator", default=None,
                       help="host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=positive_int, default=None)
    group.add_argument("--process-id", type=int, default=None)
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run described by the cluster (Slurm, Open MPI, Kubernetes, "
                            "Cloud TPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported here so --help answers without starting JAX.
    import llm_jax
    from llm_jax import distributed
    from llm_jax.sampling import Sampling

    prompts = args.prompts
    if not prompts:
        raise CliError("give at least one --prompt or --prompt-ids")
    if args.distributed or distributed.requested(args.coordinator, args.num_processes, args.process_id):
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        except distributed.DistributedError as e:
            raise CliError(str(e)) from None
    process = distributed.process_info()
    # Every process runs the same program; several processes always shard over all their devices.
    mesh = args.mesh if args.mesh is not None or process.num_processes == 1 else llm_jax.make_mesh()
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        seed=args.seed)
    model = llm_jax.load(args.model, dtype=args.dtype, attention=args.attention, mesh=mesh)
    stream = llm_jax.generate_stream(model, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                     ignore_eos=args.ignore_eos)
    if not process.is_main:  # runs its part of every step; process 0 reports
        for _ in stream:
            pass
        return 0
    if args.json:
        for _ in stream:
            pass
        m = stream.metrics
        out = {"model": args.model,
               "results": [{"prompt": r.prompt, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                            "text": r.text, "finish_reason": r.finish_reason} for r in stream.results],
               "metrics": {"compile_s": m.compile_s, "ttft_s": m.ttft_s, "itl_s": m.itl_s,
                           "decode_tokens_per_s": m.decode_tokens_per_s}}
        print(json.dumps(out))
        return 0
    if len(prompts) == 1:
        if isinstance(prompts[0], str):
            sys.stdout.write(prompts[0])
        for event in stream:
            sys.stdout.write(event.text if model.tokenizer else " ".join(map(str, event.token_ids)) + " ")
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        for _ in stream:
            pass
        for i, r in enumerate(stream.results):
            body = (r.prompt or "") + r.text if r.text is not None else " ".join(map(str, r.output_ids))
            print(f"--- [{i}] ({r.finish_reason})\n{body}")
    m = stream.metrics
    print(f"[ttft {m.ttft_s * 1e3:.0f} ms · compile {m.compile_s:.1f} s · itl {m.itl_s * 1e3:.1f} ms · "
          f"{m.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


def entry() -> int:
    return run_main(main)
