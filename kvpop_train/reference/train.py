"""Train the reference model through the curriculum; resumes from its checkpoint (in build/) when one exists.

    python -m kvpop_train.reference.train --out models/reference [--threads N] [--hours H]

Validation runs every --eval-every-tokens training tokens on the current stage's gate set and
decides when the curriculum advances. A checkpoint (model, optimizer, curriculum, counters,
RNG) is written every --checkpoint-minutes and on SIGTERM/SIGINT, and the model directory is
re-exported whenever the (stage, gate accuracy) reached is the best so far.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvpop_tasks import generate_split
from kvpop_train.reference.batches import IGNORE, TrainingStream
from kvpop_train.reference.checkpoint import (
    TrainingState,
    export_model,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    summarize,
)
from kvpop_train.reference.model import ReferenceModelConfig, build_model, widen_mlp
from kvpop_train.reference.model_card import render_card
from kvpop_train.reference.validation import validate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvpop_train.reference.train", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("models/reference"), help="exported model directory")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="where training state is kept to resume (default: build/checkpoints/<OUT's name>, git-ignored)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--hours", type=float, default=None, help="wall-clock limit of this run")
    parser.add_argument("--max-total-hours", type=float, default=8.0, help="training budget over all runs")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-every-tokens", type=int, default=2_000_000)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (faster for models of a few million parameters and up)")
    parser.add_argument("--val-tasks", type=int, default=128)
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    parser.add_argument("--widen-mlp", type=int, default=None, help="resume with MLPs widened to this size (keeps what was learned)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint_dir = args.checkpoint_dir or Path("build") / "checkpoints" / args.out.name
    payload = None if args.fresh else load_checkpoint(checkpoint_dir)

    state = payload["state"] if payload else TrainingState(model_config=ReferenceModelConfig())
    torch.manual_seed(0)
    model = build_model(state.model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    if payload:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        restore_rng(payload)
        if args.widen_mlp is not None and args.widen_mlp != state.model_config.intermediate_size:
            model, state.model_config = widen_mlp(model, state.model_config, args.widen_mlp)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
            state.notes.append(f"step {state.step}: MLP widened to {args.widen_mlp} (fresh optimizer state)")
        print(f"resumed at step {state.step}, {state.tokens / 1e6:.1f}M tokens, stage {state.curriculum.current.name}", flush=True)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters} parameters {asdict(state.model_config)}; threads {args.threads}", flush=True)
    state.curriculum.begin(state.step, state.tokens, state.seconds)
    stream = TrainingStream(state.next_task_index)
    model.train()

    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: stop.update(signal=number))

    run_start = time.monotonic()
    run_tokens = 0
    last_checkpoint = time.monotonic()
    next_eval = (state.tokens // args.eval_every_tokens + 1) * args.eval_every_tokens
    val_cache: dict[str, list] = {}
    progress = tqdm(initial=state.step, unit="step", mininterval=30, dynamic_ncols=True)

    def tokens_per_second() -> float:
        return run_tokens / max(1e-9, time.monotonic() - run_start)

    def checkpoint(reason: str) -> None:
        nonlocal last_checkpoint
        state.next_task_index = stream.next_index
        save_checkpoint(checkpoint_dir, model, optimizer, state)
        name = state.curriculum.current.name
        latest = [r["accuracy"] for r in state.history if r["stage"] == name]  # gate accuracy of this model
        rank = (state.curriculum.stage, latest[-1] if latest else 0.0)
        exported = ""
        if tuple(rank) > tuple(state.exported_rank) or not (args.out / "model.safetensors").exists():
            state.exported_rank = rank
            summary = summarize(state, parameters, args.threads, tokens_per_second())
            export_model(args.out, model, summary, render_card(summary))
            save_checkpoint(checkpoint_dir, model, optimizer, state)
            exported = f", exported stage {rank[0]} accuracy {rank[1]:.3f}"
        print(f"checkpoint ({reason}) at step {state.step}{exported}", flush=True)
        last_checkpoint = time.monotonic()

    while not state.curriculum.finished:
        stage = state.curriculum.current
        lr = args.lr * min(1.0, (state.step + 1) / args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_start = time.monotonic()
        batch = stream.batch(stage.mixture, stage.tokens_per_batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch.input_ids).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        tokens = int((batch.input_ids != 0).sum())
        state.step += 1
        state.tokens += tokens
        run_tokens += tokens
        state.seconds += time.monotonic() - step_start
        progress.update(1)
        progress.set_postfix(stage=stage.name, loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_second():.0f}", refresh=False)

        if state.tokens >= next_eval:
            next_eval += args.eval_every_tokens
            eval_start = time.monotonic()
            if stage.name not in val_cache:
                val_cache[stage.name] = generate_split(stage.gate, "validation", args.val_tasks)
            result = validate(model, val_cache[stage.name])
            state.seconds += time.monotonic() - eval_start
            record = {
                "step": state.step,
                "tokens": state.tokens,
                "hours": round(state.seconds / 3600, 4),
                "stage": stage.name,
                "accuracy": result.accuracy,
                "loss": result.loss,
                "role_accuracy": result.role_accuracy,
                "train_loss": loss.item(),
                "tokens_per_second": round(tokens_per_second()),
            }
            state.history.append(record)
            print("validation " + json.dumps(record), flush=True)
            if state.curriculum.report(result.accuracy, state.step, state.tokens, state.seconds):
                print(f"stage {stage.name} passed -> {state.curriculum.current.name}", flush=True)
                checkpoint("stage passed")

        out_of_time = args.hours is not None and time.monotonic() - run_start > args.hours * 3600
        out_of_budget = state.seconds > args.max_total_hours * 3600
        if stop["signal"] is not None or out_of_time or out_of_budget:
            break
        if time.monotonic() - last_checkpoint > args.checkpoint_minutes * 60:
            checkpoint("periodic")

    progress.close()
    checkpoint("end" if stop["signal"] is None else f"signal {stop['signal']}")
    print(f"stopped at step {state.step}, {state.tokens / 1e6:.1f}M tokens, {state.seconds / 3600:.2f} h", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
