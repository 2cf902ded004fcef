"""Hammer bls_front (the pre-fix front-end pattern) and count requests until its stub dies.

    python -m loadtest.bls_repro.run --seconds 120 --concurrency 32
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from kvpop.serving.process import TritonServer, free_port

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--responses", type=int, default=4, help="decoupled responses per request")
    parser.add_argument("--watcher", type=int, default=1)
    parser.add_argument("--hold", type=int, default=0, help="1: Python keeps the last reference to BLS responses")
    parser.add_argument("--log", type=Path, default=Path("run/bls-repro.log"))
    args = parser.parse_args()
    os.environ["KVPOP_REPRO_WATCHER"] = str(args.watcher)
    os.environ["KVPOP_REPRO_HOLD"] = str(args.hold)
    args.log.unlink(missing_ok=True)
    server = TritonServer(HERE / "models", free_port(), free_port(), free_port(), "127.0.0.1", None, args.log)
    done, failed, stop = [0], [0], time.time() + args.seconds
    first_failure = [None]
    lock = threading.Lock()

    def client_loop():
        with httpclient.InferenceServerClient(server.http_url, network_timeout=30) as client:
            text = httpclient.InferInput("text_input", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"x" * 512]], dtype=np.object_))
            count = httpclient.InferInput("count", [1, 1], "INT32")
            count.set_data_from_numpy(np.array([[args.responses]], dtype=np.int32))
            while time.time() < stop:
                try:
                    client.infer("bls_front", [text, count])
                    with lock:
                        done[0] += 1
                except Exception as error:
                    with lock:
                        failed[0] += 1
                        if first_failure[0] is None:
                            first_failure[0] = (done[0], str(error)[:120])
                    if failed[0] > 20:
                        return
    started = time.time()
    with server:
        threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    crash = [line.strip()[:160] for line in args.log.read_text(errors="replace").splitlines()
             if any(marker in line for marker in ("free()", "malloc()", "double free", "corrupted", "lock_exception",
                                                   "Segmentation", "not healthy", "Signal (11)", "Signal (6)"))]
    print(json.dumps({"watcher": args.watcher, "hold": args.hold, "seconds": round(time.time() - started, 1), "completed": done[0], "failed": failed[0],
                      "first_failure_after": first_failure[0], "crash_log": crash[:5]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
