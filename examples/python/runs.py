#!/usr/bin/env python3
"""Starts runs and sends signals over Ductor's HTTP API, with an API key.

In: the API's base URL (``--api``, default ``$DUCTOR_API_URL``) and a key
made by ``ductor keys create`` (``$DUCTOR_API_KEY``: a key on the command
line would show in the process list). Out: one JSON line per run started
(its index, run id, HTTP status and the trace id it was started in, sent as
a W3C ``traceparent``), then a summary line.
Guarantees: a start carries an ``Idempotency-Key`` and a signal a
``signal_id`` derived from it, so that retrying either after a lost answer,
a 429 or a 503 gives the one run and the one signal, never a second.

    DUCTOR_API_KEY=dk_... python runs.py --api http://127.0.0.1:8080 \\
        start --workflow order --count 10 --signal payment_confirmed
    python runs.py --api ... signal RUN_ID payment_confirmed --payload '{"ok": true}'
    python runs.py --api ... get RUN_ID
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Tries of one request that got no answer, 429 or 503, and the wait
# between them (a Retry-After from the server wins, up to the cap).
MAX_TRIES = 8
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0
TIMEOUT_S = 30.0
RETRIED_STATUSES = {429, 503}


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class Api:
    def __init__(self, base: str, key: str) -> None:
        self.base = base.rstrip("/")
        self.key = key

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        all_headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json"}
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        all_headers.update(headers or {})
        wait = RETRY_MIN_S
        for attempt in range(1, MAX_TRIES + 1):
            request = urllib.request.Request(self.base + path, data=data, method=method, headers=all_headers)
            try:
                with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                    return answer.status, json.loads(answer.read() or b"null")
            except urllib.error.HTTPError as e:
                text = e.read()
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = text.decode(errors="replace")
                if e.code not in RETRIED_STATUSES or attempt == MAX_TRIES:
                    raise ApiError(e.code, payload) from None
                retry_after = e.headers.get("Retry-After")
                if retry_after and retry_after.isdigit():
                    wait = max(wait, float(retry_after))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                # No answer: the request may or may not have been acted on;
                # the idempotency key makes the retry safe either way.
                if attempt == MAX_TRIES:
                    raise
            time.sleep(min(wait, RETRY_MAX_S))
            wait = min(wait * 2, RETRY_MAX_S)
        raise AssertionError("unreachable")

    def start(
        self, workflow: str, idempotency_key: str, run_input: Any, pool: str | None, traceparent: str
    ) -> tuple[int, dict]:
        body: dict[str, Any] = {"workflow": workflow, "input": run_input}
        if pool:
            body["pool"] = pool
        headers = {"Idempotency-Key": idempotency_key, "traceparent": traceparent}
        return self.request("POST", "/v1/runs", body, headers)

    def signal(self, run_id: str, name: str, signal_id: str, payload: Any) -> tuple[int, dict]:
        body = {"name": name, "signal_id": signal_id, "payload": payload}
        return self.request("POST", f"/v1/runs/{run_id}/signals", body)

    def get(self, run_id: str) -> tuple[int, dict]:
        return self.request("GET", f"/v1/runs/{run_id}")


def start_many(api: Api, args: argparse.Namespace) -> int:
    prefix = args.idempotency_prefix or uuid.uuid4().hex
    base_input = json.loads(args.input)

    def one(index: int) -> dict[str, Any]:
        run_input = dict(base_input, order=index, amount=args.amount + index)
        key = f"{prefix}-{index}"
        # Each run is a trace of its own, rooted here: every hop in Ductor
        # and the worker's results carry its trace id.
        traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        status, decision = api.start(args.workflow, key, run_input, args.pool, traceparent)
        line: dict[str, Any] = {
            "index": index,
            "run_id": decision["run_id"],
            "status": status,
            "trace_id": traceparent.split("-")[1],
        }
        if args.signal:
            signal_status, _ = api.signal(decision["run_id"], args.signal, f"{key}/{args.signal}", {"index": index})
            line["signal_status"] = signal_status
        return line

    started = 0
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for line in pool.map(one, range(args.count)):
            print(json.dumps(line), flush=True)
            started += 1
    print(json.dumps({"started": started}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", default=os.environ.get("DUCTOR_API_URL", "http://127.0.0.1:8080"))
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start runs, each with its own idempotency key")
    start.add_argument("--workflow", required=True)
    start.add_argument("--pool", help="the routing pool (default: the server's, 'default')")
    start.add_argument("--count", type=int, default=1)
    start.add_argument("--input", default="{}", help="JSON object each run's input starts from")
    start.add_argument("--amount", type=int, default=100, help="run i's input gets amount + i")
    start.add_argument("--signal", help="then send each run this signal")
    start.add_argument("--idempotency-prefix", help="keys are <prefix>-<index> (default: random)")
    start.add_argument("--concurrency", type=int, default=8)
    signal = commands.add_parser("signal", help="send one signal")
    signal.add_argument("run_id")
    signal.add_argument("name")
    signal.add_argument("--payload", default="null", help="JSON")
    signal.add_argument("--signal-id", help="default: a random one (a retry then signals twice)")
    get = commands.add_parser("get", help="read one run")
    get.add_argument("run_id")
    args = parser.parse_args()

    key = os.environ.get("DUCTOR_API_KEY")
    if not key:
        parser.error("DUCTOR_API_KEY is not set")
    api = Api(args.api, key)
    try:
        if args.command == "start":
            return start_many(api, args)
        if args.command == "signal":
            status, body = api.signal(
                args.run_id, args.name, args.signal_id or str(uuid.uuid4()), json.loads(args.payload)
            )
        else:
            status, body = api.get(args.run_id)
    except ApiError as e:
        print(json.dumps({"status": e.status, "error": e.body}), file=sys.stderr)
        return 1
    print(json.dumps({"status": status, **body}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
