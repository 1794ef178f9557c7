"""The smallest stand-in for ``vllm serve`` that speaks the HTTP API eagle3lab.engines.vllm_served uses.

It takes vllm serve's command line (unknown options ignored) and serves, on --host/--port:
- ``GET /health``: 200 once started;
- ``POST /v1/completions``: token-id prompts; the "model" continues each prompt with (last id + 1) mod
  VOCAB, and returns the ids in ``choices[0].token_ids`` when ``return_token_ids`` is set, as vLLM does;
- ``GET /metrics``: Prometheus text made by prometheus_client with vLLM's spec-decode counters
  (``vllm:spec_decode_num_drafts`` ..., ``..._per_pos`` with a ``position`` label) when started with
  --speculative-config. Every draft round proposes k tokens and has the first one accepted, so a
  request of n new tokens counts ceil((n - 1) / 2) rounds (the first token comes from the prefill).

Like vLLM it runs helper processes in its own process group (STANDIN_CHILDREN of them, as vLLM's engine
core and workers), and on SIGTERM it stops them and exits. Misbehaviour for the lifecycle tests, by
environment variable: STANDIN_DELAY_S (seconds before it listens), STANDIN_NEVER_HEALTHY=1 (/health
answers 503), STANDIN_EXIT (exit with this code after the delay, printing an error first),
STANDIN_IGNORE_TERM=1 (the server and its helpers ignore SIGTERM: only SIGKILL ends them),
STANDIN_NO_FORWARD=1 (on SIGTERM the server exits without stopping its helpers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, generate_latest

VOCAB = 320
CHILD_CODE = (
    "import signal, sys, time\n"
    "if sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while True: time.sleep(1)\n"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    p.add_argument("--model", dest="model_opt")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="target")
    p.add_argument("--speculative-config", default=None)
    args, _ = p.parse_known_args(argv)
    return args


def make_metrics(model_name: str, k: int) -> tuple[CollectorRegistry, dict[str, object]]:
    """vLLM's spec-decode counters (names and labels as in vllm/v1/spec_decode/metrics.py)."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    c = {
        name: Counter(f"vllm:spec_decode_{name}", name, labels, registry=reg).labels(model_name, "0")
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", [*labels, "position"], registry=reg)
    c["per_pos"] = [per_pos.labels(model_name, "0", str(i)) for i in range(k)]
    return reg, c


def main() -> None:
    args = parse_args(sys.argv[1:])
    ignore_term = os.environ.get("STANDIN_IGNORE_TERM") == "1"
    print(f"standin: model={args.model or args.model_opt} port={args.port}", flush=True)
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD_CODE, "1" if ignore_term else "0"])
        for _ in range(int(os.environ.get("STANDIN_CHILDREN", "0")))
    ]

    def on_term(signum: int, frame: object) -> None:
        if os.environ.get("STANDIN_NO_FORWARD") == "1":
            sys.exit(0)  # leaves its helpers running: only a signal to the whole group reaches them
        for ch in children:
            ch.terminate()
        for ch in children:
            ch.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else on_term)
    time.sleep(float(os.environ.get("STANDIN_DELAY_S", "0")))
    if os.environ.get("STANDIN_EXIT"):
        print("standin: RuntimeError: deliberate failure before serving", flush=True)
        sys.exit(int(os.environ["STANDIN_EXIT"]))
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    k = int(spec["num_speculative_tokens"]) if spec else 0
    registry, counters = make_metrics(args.served_model_name, k)
    healthy = os.environ.get("STANDIN_NEVER_HEALTHY") != "1"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            print("standin:", fmt % a, flush=True)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if healthy else 503, b"")
            elif self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, b"{}")
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("model") != args.served_model_name:
                self._send(404, json.dumps({"error": f"model {req.get('model')!r} does not exist"}).encode())
                return
            prompts = req["prompt"]
            n = int(req["max_tokens"])
            choices = []
            for i, prompt in enumerate(prompts):
                ids = [(prompt[-1] + 1 + j) % VOCAB for j in range(n)]
                choice: dict[str, object] = {"index": i, "text": "", "finish_reason": "length", "logprobs": None}
                if req.get("return_token_ids"):
                    choice["token_ids"] = ids
                    choice["prompt_token_ids"] = prompt
                choices.append(choice)
                if k:
                    rounds = math.ceil((n - 1) / 2)
                    counters["num_drafts"].inc(rounds)
                    counters["num_draft_tokens"].inc(rounds * k)
                    counters["num_accepted_tokens"].inc(rounds)
                    counters["per_pos"][0].inc(rounds)
            body = {
                "id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                "model": args.served_model_name, "choices": choices,
                "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": n * len(prompts),
                          "total_tokens": sum(map(len, prompts)) + n * len(prompts)},
            }  # fmt: skip
            self._send(200, json.dumps(body).encode())

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print("standin: listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
