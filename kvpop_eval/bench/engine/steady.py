"""The bounded cache's steady decode step, engine alone and through the real server (a program, not a test).

    python -m kvpop_eval.bench.engine steady --model model_repository/kvpop_engine/1 --budget 922 \
        --out build/results/steady/steady_decode.json

Workload (b) spends nearly all its time in one state: every stream's kvpop cache is full (`--budget`
slots per head) and each step appends one token per stream and evicts one. This program measures that
state directly instead of over a two-hour run:
  * engine alone: `--streams` sequences of `--prompt-tokens` random tokens decode until their caches
    are full (`--fill` steps), then `--steps` steps are timed, with the profile's timers around the
    decoder call (what is left is the scorer, the eviction and sampling);
  * through the server (unless --no-server): the same sequences as streaming gRPC requests from as
    many client threads, `--server-tokens` tokens each; the token gaps per 250-token stretch show
    whether the step stays flat over the run and what the server path adds to the engine's step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvpop_eval.bench.engine.profile import CALLS, DECODER_TIMER, TIMERS, instrument, prompt
from kvpop.decoder import DecoderStep
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop_eval.engine_factory import build_engine
from kvpop.model_spec import ModelSpec
from kvpop_eval.provenance import stamp

STRETCH = 250  # tokens per row of the server's gap table


def engine_steady(model: Path, budget: int, streams: int, prompt_tokens: int, fill: int, steps: int, scorer: str) -> dict:
    engine = build_engine(model, decoder=DecoderStep(model), max_batch_size=streams)
    instrument(engine)
    rng = np.random.default_rng(0)
    for index in range(streams):
        engine.add_request(GenerationRequest(
            f"steady{index}", prompt(rng, prompt_tokens, engine.spec.vocab_size),
            SamplingParams(max_tokens=fill + steps + 1, ignore_eos=True), CacheConfig("kvpop", budget=budget, options=dict(scorer=scorer)),
        ))
    for step in range(fill):
        engine.step()
        if step % 100 == 0:
            print(f"[steady] engine: filling, step {step}/{fill}", flush=True)
    TIMERS.clear()
    CALLS.clear()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    caches_full = all(engine.sequence(name).cache.length == budget for name in engine.state().decoding)
    decoder_ms = TIMERS[DECODER_TIMER] / steps * 1e3
    return {
        "streams": streams, "budget": budget, "caches_full": caches_full,
        "step_ms_median": float(np.median(walls)) * 1e3, "step_ms_mean": float(np.mean(walls)) * 1e3,
        "decoder_ms_per_step": decoder_ms, "rest_ms_per_step": float(np.mean(walls)) * 1e3 - decoder_ms,
    }


def server_steady(model: Path, budget: int, streams: int, prompt_tokens: int, tokens: int) -> dict:
    from kvpop_eval.bench.service import prompts, start_triton
    from kvpop_client import KVpopClient

    scratch = Path(tempfile.mkdtemp(prefix="steady-decode-"))
    parameters = {"max_output_tokens": str(max(1024, tokens)), "kv_pool_mb": "4096"}
    server = start_triton(model, scratch / "repo", parameters, scratch / "triton.log")
    options = {"eviction_policy": "kvpop", "kv_budget": budget}
    try:
        work = prompts(streams + 1, prompt_tokens, ModelSpec.load(model).vocab_size, seed=0)
        with KVpopClient(server.grpc_url, protocol="grpc") as client:  # warm up
            list(client.stream(work[-1][:64], 4, ignore_eos=True, **options))
        token_times: list[list[float]] = [[] for _ in range(streams)]

        def stream(index: int) -> None:
            with KVpopClient(server.grpc_url, protocol="grpc", timeout=3 * 3600) as client:
                for chunk in client.stream(work[index], tokens, ignore_eos=True, **options):
                    token_times[index].extend([time.perf_counter()] * len(chunk.token_ids))

        print(f"[steady] server: {streams} streams x {tokens} tokens", flush=True)
        threads = [threading.Thread(target=stream, args=(index,)) for index in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # the model repository holds a copy of the weights
    stretches = []
    for begin in range(0, tokens - 1, STRETCH):
        gaps = np.concatenate([np.diff(times[begin : begin + STRETCH + 1]) for times in token_times])
        stretches.append({"tokens": [begin, min(begin + STRETCH, tokens)], "gap_ms_median": float(np.median(gaps)) * 1e3,
                          "gap_ms_mean": float(np.mean(gaps)) * 1e3})
    return {"streams": streams, "tokens": tokens, "stretches": stretches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.engine steady", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory")
    parser.add_argument("--budget", type=int, default=922, help="kvpop slots per head (922: 88%% of 512 + 7168)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--fill", type=int, default=420, help="engine steps before timing (the caches fill up)")
    parser.add_argument("--steps", type=int, default=60, help="engine steps timed")
    parser.add_argument("--scorer", default="mlstm", help="the kvpop scorer (a learned kind exported with the model)")
    parser.add_argument("--server-tokens", type=int, default=2500, help="tokens per stream through the server")
    parser.add_argument("--no-server", action="store_true", help="the engine alone")
    parser.add_argument("--out", type=Path, help="JSON to write")
    args = parser.parse_args(argv)

    report = {"model": str(args.model), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "engine": engine_steady(args.model, args.budget, args.streams, args.prompt_tokens, args.fill, args.steps, args.scorer)}
    engine = report["engine"]
    print(f"[steady] engine: step {engine['step_ms_median']:.1f} ms (median), decoder {engine['decoder_ms_per_step']:.1f} ms, "
          f"the rest {engine['rest_ms_per_step']:.1f} ms; caches full: {engine['caches_full']}", flush=True)
    if not args.no_server:
        report["server"] = server_steady(args.model, args.budget, args.streams, args.prompt_tokens, args.server_tokens)
        for stretch in report["server"]["stretches"]:
            print(f"[steady] server tokens {stretch['tokens'][0]}-{stretch['tokens'][1]}: gap median "
                  f"{stretch['gap_ms_median']:.1f} ms, mean {stretch['gap_ms_mean']:.1f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(stamp(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
