"""`python -m kvpop.openai_api`: serve the OpenAI-compatible API against a running tritonserver."""

from __future__ import annotations

import argparse
import os

from kvpop.openai_api.app import Settings, create_app
from kvpop.openai_api.body import MAX_BODY_BYTES

API_KEY_ENV = "KVPOP_OPENAI_API_KEY"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m kvpop.openai_api", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (containers: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001", help="tritonserver's gRPC endpoint")
    parser.add_argument("--engine-model", default="kvpop_engine", help="the Triton model to forward to (the model id)")
    parser.add_argument("--api-key-env", default=API_KEY_ENV,
                        help=f"environment variable holding the API key (default {API_KEY_ENV}); unset: no key")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help=f"larger request bodies are refused with 413 before they are read (default {MAX_BODY_BYTES})")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    settings = Settings(triton_grpc_url=args.triton_grpc, engine_model=args.engine_model,
                        api_key=os.environ.get(args.api_key_env) or None, max_body_bytes=args.max_body_bytes)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
