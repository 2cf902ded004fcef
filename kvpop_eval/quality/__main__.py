"""CLI of the quality harness (see the package docstring): a single run, a sweep, or a merge of sweeps."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpop.request import CacheConfig
from kvpop.policies import POLICIES
from kvpop.policies.kvpop.text_spans import SPAN_POOLINGS
from kvpop_eval import quality
from kvpop_eval.engine_factory import AUTO_SCORER, build_engine, resolve_scorer
from kvpop_eval.provenance import stamp
from kvpop_eval.quality.harness import evaluate, sweep
from kvpop_eval.quality.report import concat_sweeps, merge_sweeps
from kvpop_eval.quality.tasks_io import SWEEP_COMPRESSIONS, load_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.quality", description=quality.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="exported model directory (decoder_step.onnx); required unless --merge")
    parser.add_argument("--tasks", type=Path, help="JSONL with 'prompt' and 'answer' per line; required unless --merge")
    parser.add_argument("--policy", choices=list(POLICIES), default="full")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, help="slots per head")
    size.add_argument("--compression", type=float, help="0 <= r < 1")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--whole-prompt-tokens", type=int, default=8192,
                        help="a bounded cache whose policy reads no attention prefills prompts up to this long whole, "
                             "then evicts (the service's whole_prompt_tokens); 0: evict while prefilling")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--scoring", choices=["final_answer", "contains"], default="final_answer")
    parser.add_argument("--out", type=Path, help="report JSON (single run)")
    parser.add_argument("--sweep", action="store_true", help="every policy x --compressions")
    parser.add_argument("--out-dir", type=Path, help="sweep output folder")
    parser.add_argument("--policies", help="sweep: comma-separated policies or kvpop:<scorer> (default: all)")
    parser.add_argument("--scorer", default=AUTO_SCORER,
                        help="single run, kvpop policy: its scorer (auto: as the service, the exported mLSTM when present)")
    parser.add_argument("--span-pooling", choices=SPAN_POOLINGS, default=None,
                        help="kvpop: how prompt tokens are ranked by span (default: as the scorer was trained; '' for none)")
    parser.add_argument("--query-window", type=int, default=None,
                        help="kvpop: the prompt's last queries that pick slots when it enters whole (default: the policy's; 0: off)")
    parser.add_argument("--compressions", default=",".join(str(r) for r in SWEEP_COMPRESSIONS))
    parser.add_argument("--skip-full", action="store_true", help="sweep: do not run the full cache (rows for --merge)")
    parser.add_argument("--merge", type=Path, nargs="+", help="merge these sweep folders (same tasks) into --out-dir; runs nothing")
    parser.add_argument("--concat", type=Path, nargs="+",
                        help="join these sweep folders, run on consecutive pieces of --tasks, into one sweep over it (--out-dir); runs nothing")
    args = parser.parse_args(argv)

    if args.merge:
        if args.out_dir is None:
            parser.error("--merge needs --out-dir")
        merge_sweeps(args.merge, args.out_dir)
        print(f"merged {len(args.merge)} sweeps into {args.out_dir}")
        return 0
    if args.concat:
        if args.out_dir is None or args.tasks is None:
            parser.error("--concat needs --tasks (the whole file) and --out-dir")
        summary = concat_sweeps(args.concat, args.tasks, args.out_dir)
        print(f"concatenated {len(args.concat)} sweeps ({len(summary)} cells) into {args.out_dir}")
        return 0
    if args.model is None or args.tasks is None:
        parser.error("--model and --tasks are required (except with --merge or --concat)")

    kvpop_options = {name: value for name, value in (("span_pooling", args.span_pooling), ("query_window", args.query_window))
                     if value is not None}
    tasks = load_tasks(args.tasks, args.limit)
    engine = build_engine(args.model, device=args.device, max_batch_size=args.batch_size, prefill_chunk=args.prefill_chunk,
                          whole_prompt_tokens=args.whole_prompt_tokens)
    if args.sweep:
        if args.out_dir is None:
            parser.error("--sweep needs --out-dir")
        default = [*POLICIES, *(f"kvpop:{kind}" for kind in engine.policy_assets.get("kvpop", {}))]
        policies = [name.strip() for name in args.policies.split(",") if name.strip()] if args.policies else default
        unknown = [name for name in policies if name.partition(":")[0] not in POLICIES]
        if unknown:
            parser.error(f"unknown policies {unknown}; registered: {', '.join(POLICIES)}")
        compressions = tuple(float(ratio) for ratio in args.compressions.split(","))
        sweep(engine, tasks, args.out_dir, policies, compressions, args.max_tokens, args.scoring, args.sinks, args.window,
              tasks_file=args.tasks if not args.limit else None, run_full=not args.skip_full, kvpop_options=kvpop_options)
        print(f"wrote {args.out_dir}/sweep.json, sweep.md, accuracy_vs_compression.png")
        return 0
    if args.out is None:
        parser.error("a single run needs --out")
    try:
        config = CacheConfig(policy=args.policy, budget=args.budget, compression=args.compression,
                             options=dict(sinks=args.sinks, window=args.window, scorer=resolve_scorer(args.scorer, engine.policy_assets.get("kvpop", {})),
                                          **(kvpop_options if args.policy == "kvpop" else {})))
    except ValueError as error:
        parser.error(str(error))
    report = stamp(evaluate(engine, tasks, config, args.max_tokens, args.scoring))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.policy}: accuracy {report['accuracy']:.3f} on {report['tasks']} tasks, "
          f"compression {report['compression_achieved']:.1%} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
