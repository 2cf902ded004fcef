"""`kvpop-client`: talk to a KVpop service from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvpop_client.client import KVpopClient
from kvpop_client.errors import KVpopClientError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpop-client", description=__doc__)
    parser.add_argument("--url", help="server address (default localhost:8000 for http, :8001 for grpc)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("health", help="exit 0 when the server and model are ready")
    generate = commands.add_parser("generate", help="generate a completion")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--policy", dest="eviction_policy")
    generate.add_argument("--kv-budget", type=int)
    generate.add_argument("--compression-ratio", type=float)
    generate.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    generate.add_argument("--json", action="store_true", help="print the whole validated result as JSON")
    chat = commands.add_parser("chat", help="chat interactively (one user turn per line, answers streamed)")
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.add_argument("--max-tokens", type=int)
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--policy", dest="eviction_policy")
    chat.add_argument("--kv-budget", type=int)
    chat.add_argument("--compression-ratio", type=float)
    chat.add_argument("--no-session", dest="session", action="store_false",
                      help="send the whole history every turn without a server-side session (every turn prefills it all)")
    chat.add_argument("--show-reuse", action="store_true",
                      help="after each answer, print to stderr how many prompt tokens the session reused and how many were computed")
    metrics = commands.add_parser("metrics", help="print the kvpop_* Prometheus metrics")
    metrics.add_argument("--metrics-url", default="http://localhost:8002/metrics")
    args = parser.parse_args(argv)

    try:
        with KVpopClient(args.url, args.protocol) as client:
            if args.command == "metrics":
                for name, value in sorted(client.metrics(args.metrics_url).items()):
                    if name.startswith("kvpop_"):
                        print(f"{name} {value:g}")
                return 0
            if args.command == "health":
                ready = client.is_ready()
                print("ready" if ready else "not ready")
                return 0 if ready else 1
            if args.command == "chat":
                return _chat(client, args)
            options = {
                name: getattr(args, name)
                for name in ("temperature", "top_p", "top_k", "seed", "eviction_policy", "kv_budget", "compression_ratio")
            }
            if args.stream:
                result = None
                for chunk in client.stream(args.prompt, max_tokens=args.max_tokens, stop=args.stop, **options):
                    if not args.json:
                        print(chunk.text, end="", flush=True)
                    result = chunk.result or result
                print(json.dumps(asdict(result), indent=2) if args.json else "")
                return 0
            result = client.generate(args.prompt, max_tokens=args.max_tokens, stop=args.stop, **options)
            print(json.dumps(asdict(result), indent=2) if args.json else result.text)
            return 0
    except (KVpopClientError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _chat(client: KVpopClient, args: argparse.Namespace) -> int:
    """Read user turns from stdin until EOF, "exit" or Ctrl-C, streaming each answer and keeping the
    history. One server-side session (a random id) spans the turns, so each turn computes only its new
    tokens; it is closed on the way out."""
    options = {name: getattr(args, name) for name in ("temperature", "eviction_policy", "kv_budget", "compression_ratio")}
    session = client.session(**options) if args.session else None
    if session is not None and args.show_reuse:
        print(f"[session {session.id}]", file=sys.stderr, flush=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("exit", "quit"):
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            answer, result = [], None
            chunks = session.stream_chat(messages, max_tokens=args.max_tokens) if session else \
                client.stream_chat(messages, max_tokens=args.max_tokens, **options)
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
                answer.append(chunk.text)
                result = chunk.result or result
            print(flush=True)
            if args.show_reuse and result is not None:
                print(f"[tokens reused {result.tokens_reused}, computed {result.tokens_computed}]", file=sys.stderr, flush=True)
            # Stripped as the chat template expects; a template that renders it back to the same
            # tokens lets the next turn reuse the whole conversation.
            messages.append({"role": "assistant", "content": "".join(answer).strip()})
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        if session is not None and len(messages) > (1 if args.system else 0):
            session.close()


if __name__ == "__main__":
    sys.exit(main())
