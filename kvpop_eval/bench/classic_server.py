"""The classic design, for comparison only: a FastAPI app calling Hugging Face `generate` with a full
cache and a simple dynamic batcher (collect what arrives within `--max-wait-ms`, up to `--max-batch`,
left-pad, one `generate` call, answer everyone). Not part of the service.

    python -m kvpop_eval.bench.classic_server --model models/reference --port 8100

POST /generate {"input_ids": [...], "max_tokens": 32} -> {"output_ids": [...], "batch_size": n}
Requests batched together share one `generate` call, so each waits for the longest of its batch
(as a simple dynamic batcher does); greedy, EOS ignored so every request makes `max_tokens` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel


@dataclass
class _Job:
    input_ids: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    output_ids: list[int] | None = None
    batch_size: int = 0
    error: str | None = None


class DynamicBatcher:
    """One thread that runs `generate` over whatever queued within max_wait of the first request."""

    def __init__(self, model_dir: Path, max_batch: int, max_wait_ms: float, threads: int, device: str = "cpu",
                 dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.pad = self.model.config.pad_token_id or 0
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000
        self.queue: list[_Job] = []
        self.condition = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, job: _Job) -> None:
        with self.condition:
            self.queue.append(job)
            self.condition.notify()

    def _take(self) -> list[_Job]:
        with self.condition:
            while not self.queue:
                self.condition.wait()
            self.condition.wait_for(lambda: len(self.queue) >= self.max_batch, timeout=self.max_wait)
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            return batch

    def _run(self) -> None:
        torch = self.torch
        while True:
            batch = self._take()
            try:
                longest = max(len(job.input_ids) for job in batch)
                ids = torch.full((len(batch), longest), self.pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, job in enumerate(batch):  # left padding
                    ids[row, longest - len(job.input_ids) :] = torch.tensor(job.input_ids)
                    mask[row, longest - len(job.input_ids) :] = 1
                new_tokens = max(job.max_tokens for job in batch)
                with torch.no_grad():
                    out = self.model.generate(
                        ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, pad_token_id=self.pad,
                    )
                for row, job in enumerate(batch):
                    job.output_ids = out[row, longest : longest + job.max_tokens].tolist()
                    job.batch_size = len(batch)
            except Exception as error:  # answer the batch, keep serving
                for job in batch:
                    job.error = f"{type(error).__name__}: {error}"
            for job in batch:
                job.done.set()


class GenerateRequest(BaseModel):
    input_ids: list[int]
    max_tokens: int = 32


def build_app(batcher: DynamicBatcher):
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="classic design (comparison only)")

    @app.post("/generate")
    async def generate(request: GenerateRequest) -> dict:
        job = _Job(request.input_ids, request.max_tokens)
        batcher.submit(job)
        await asyncio.get_running_loop().run_in_executor(None, job.done.wait)
        if job.error:
            raise HTTPException(500, job.error)
        return {"output_ids": job.output_ids, "batch_size": job.batch_size}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU), cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="weights as the service's export has them (a GPU export may be float16)")
    args = parser.parse_args(argv)
    import uvicorn

    app = build_app(DynamicBatcher(args.model, args.max_batch, args.max_wait_ms, args.threads, args.device, args.dtype))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
