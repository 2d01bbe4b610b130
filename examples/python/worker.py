#!/usr/bin/env python3
"""A Ductor step worker in Python, for one pool.

In: the pool's ``step.dispatch`` records (``<prefix>steps.<pool>``), read in
the pool's consumer group (the one Ductor's Rust worker library uses).
Out: one ``attempt.result`` per dispatch on ``<prefix>attempt-results``,
keyed by its run, carrying the dispatch's stamp and continuing its W3C
trace (``traceparent``, ``tracestate``), signed when the tenant has a
signing key; and, for the ``charge`` step, a charge in a payments ledger
(a Postgres table standing in for a payment service) made with the step's
``step_key`` as its idempotency key.
Guarantees: a dispatch's offset is committed only after the broker has
acknowledged its result, so a worker that dies at any point leaves its
dispatches to be read again (or timed out and retried by Ductor), never
lost; the step key is the same for every attempt of a step, so a step that
runs twice charges once; results land on partition ``murmur2(run_id) %
partitions``, the rule every producer of Ductor's inputs follows.

    python worker.py --pool default --database-url postgres://...

Each dispatch's output is its input plus a member named after the step.
``--strict`` stops the worker (exit 3) on any message off the contract
instead of logging it; ``--crash-after-charges N`` kills the worker with
SIGKILL right after its N-th new charge, before the result is produced (for
tests of what a crash costs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

import ductor_contract as contract

log = logging.getLogger("worker")

# Dispatches read and answered per round; their results are acknowledged
# and their offsets committed before the next round is read.
MAX_BATCH = 100
# How long one poll waits for the first dispatch of a round.
POLL_S = 0.2
# Backoff between tries of a result the broker did not acknowledge.
PUBLISH_RETRY_MIN_S = 0.1
PUBLISH_RETRY_MAX_S = 5.0
# Exit status when --strict meets a message off the contract.
EXIT_OFF_CONTRACT = 3

PAYMENTS_SQL = """
CREATE TABLE IF NOT EXISTS example_payments (
    idempotency_key text PRIMARY KEY,
    run_id text NOT NULL,
    amount bigint NOT NULL,
    charge_id text NOT NULL,
    worker_pid integer NOT NULL,
    charged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS example_payment_calls (
    id bigserial PRIMARY KEY,
    idempotency_key text NOT NULL,
    run_id text NOT NULL,
    attempt integer NOT NULL,
    stamp uuid NOT NULL,
    worker_pid integer NOT NULL,
    called_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
# Serialises the CREATEs of workers starting together.
SCHEMA_LOCK_KEY = 0x6475_6374_6F72_7079  # "ductorpy"


class Payments:
    """A payment service that honours idempotency keys, kept in Postgres:
    the first call with a key makes a charge, every later call with that key
    answers with the same charge. Each call is logged, so that the calls a
    step made can be told from the charges it caused."""

    def __init__(self, url: str, crash_after: int | None) -> None:
        self._db = psycopg.connect(url, autocommit=True)
        with self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            self._db.execute(PAYMENTS_SQL)
        self._crash_after = crash_after
        self._new_charges = 0

    def charge(self, step: contract.StepDispatch, amount: int) -> dict[str, Any]:
        key = step.step_key
        with self._db.transaction():
            self._db.execute(
                "INSERT INTO example_payment_calls (idempotency_key, run_id, attempt, stamp, worker_pid) "
                "VALUES (%s, %s, %s, %s, %s)",
                (key, step.run_id, step.attempt, step.stamp, os.getpid()),
            )
            made = self._db.execute(
                "INSERT INTO example_payments (idempotency_key, run_id, amount, charge_id, worker_pid) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING "
                "RETURNING charge_id, amount",
                (key, step.run_id, amount, f"ch_{uuid.uuid4().hex}", os.getpid()),
            ).fetchone()
            row = made or self._db.execute(
                "SELECT charge_id, amount FROM example_payments WHERE idempotency_key = %s", (key,)
            ).fetchone()
        if made is not None:
            self._new_charges += 1
            if self._crash_after is not None and self._new_charges >= self._crash_after:
                # The charge is made and its result not yet sent: the
                # window a step key exists for.
                log.warning("crashing after charge %d, as asked", self._new_charges)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return {"charge_id": row[0], "amount": row[1]}


@dataclass
class Handler:
    """What each step does: ``charge`` charges the input's ``amount`` (1 if
    none) through the payments service; every step's output is its input
    plus a member named after the step."""

    payments: Payments

    def __call__(self, step: contract.StepDispatch) -> dict[str, Any]:
        done: dict[str, Any] = {"done": True, "attempt": step.attempt, "worker_pid": os.getpid()}
        if step.step == "charge":
            amount = step.input.get("amount", 1) if isinstance(step.input, dict) else 1
            done["charge"] = self.payments.charge(step, int(amount))
        if isinstance(step.input, dict):
            output = dict(step.input)
        elif step.input is None:
            output = {}
        else:
            output = {"input": step.input}
        output[step.step] = done
        return contract.result_succeeded(step, output)


@dataclass
class Pending:
    """A result produced and not yet acknowledged."""

    payload: bytes
    key: str
    headers: list[tuple[str, bytes]]
    delivered: bool = False
    error: KafkaError | None = None
    # Where the broker put it, once acknowledged.
    partition: int | None = None


@dataclass
class Round:
    """One batch of dispatches: the results to acknowledge and the offsets
    to commit once they are."""

    pending: list[Pending] = field(default_factory=list)
    # Per (topic, partition): the next offset to read after this round.
    positions: dict[tuple[str, int], int] = field(default_factory=dict)


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        topics = contract.env_topics()
        self.steps_topic = topics.steps(args.pool)
        self.results_topic = topics.attempt_results
        self.strict = args.strict
        self.schemas = contract.Schemas()
        self.tenant_keys = contract.env_tenant_keys()
        self.handler = Handler(Payments(args.database_url, args.crash_after_charges))
        bootstrap = contract.env_bootstrap_servers()
        consumer_settings = {
            "bootstrap.servers": bootstrap,
            "group.id": args.group or contract.worker_group(args.pool),
            "client.id": f"py-worker-{args.pool}",
            "enable.auto.commit": "false",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "session.timeout.ms": str(args.session_timeout_ms),
            "enable.partition.eof": "false",
        }
        if args.instance_id:
            # Static membership: a restarted worker takes its partitions
            # back at once instead of after a rebalance.
            consumer_settings["group.instance.id"] = args.instance_id
        self.consumer = Consumer(consumer_settings)
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "client.id": f"py-worker-{args.pool}",
                "message.timeout.ms": str(args.delivery_timeout_ms),
                **contract.PRODUCER_SETTINGS,
            }
        )
        self.result_partitions: int | None = None
        self.stopping = False
        self.answered = 0

    # -- one dispatch ---------------------------------------------------

    def off_contract(self, what: str, error: Exception) -> None:
        if self.strict:
            log.error("off the contract, stopping: %s: %s", what, error)
            sys.exit(EXIT_OFF_CONTRACT)
        log.warning("off the contract: %s: %s", what, error)

    def admit(self, msg: Message) -> contract.StepDispatch | None:
        """The dispatch to run, or None for one to skip (undecodable, or
        past its deadline, counted from its publication when that was
        late); a skipped dispatch's offset is committed with the round."""
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        try:
            self.schemas.check_headers("effect", msg.headers() or [])
        except contract.OffContract as e:
            self.off_contract(where, e)
        try:
            value = json.loads(msg.value() or b"")
        except ValueError as e:
            self.off_contract(where, e)
            return None
        try:
            self.schemas.check_message(value)
        except contract.OffContract as e:
            self.off_contract(where, e)
        try:
            step = contract.StepDispatch.from_json(value)
        except (contract.OffContract, KeyError, TypeError, ValueError) as e:
            log.warning("skipping undecodable step dispatch %s: %s", where, e)
            return None
        _, record_ms = msg.timestamp()
        delay = contract.dispatch_delay(record_ms, contract.header(msg.headers(), contract.CE_TIME))
        if datetime.now(timezone.utc) >= step.deadline + delay:
            log.debug("skipping dispatch past its deadline: %s attempt %d", step.run_id, step.attempt)
            return None
        return step

    def answer(self, step: contract.StepDispatch, dispatch_headers: list[tuple[str, bytes]] | None) -> Pending:
        try:
            result = self.handler(step)
        except Exception as e:  # the step failed: let its retry policy decide
            log.warning("step %s of %s failed: %s", step.step, step.run_id, e)
            result = contract.result_failed(step, f"{type(e).__name__}: {e}", retryable=True)
        payload = contract.encode_result(step, result)
        headers = [(contract.CONTENT_TYPE, contract.JSON_CONTENT.encode())]
        # The result is the next hop of the dispatch's trace.
        headers.extend(contract.continue_trace(dispatch_headers))
        key = self.tenant_keys.get(step.tenant)
        if key is not None:
            headers.append((contract.SIGNATURE, contract.sign(key, payload).encode()))
        try:
            self.schemas.check_message(json.loads(payload))
            self.schemas.check_headers("input", headers)
        except contract.OffContract as e:
            self.off_contract(f"result of {step.run_id}", e)
        return Pending(payload=payload, key=contract.input_key(step.run_id), headers=headers)

    # -- a round --------------------------------------------------------

    def produce(self, pending: Pending) -> None:
        def delivered(err: KafkaError | None, msg: Message) -> None:
            pending.error = err
            pending.delivered = err is None
            pending.partition = msg.partition()

        while True:
            try:
                self.producer.produce(
                    self.results_topic,
                    value=pending.payload,
                    key=pending.key,
                    headers=pending.headers,
                    on_delivery=delivered,
                )
                return
            except BufferError:
                self.producer.poll(0.1)

    def check_partition(self, pending: Pending) -> None:
        """Where an acknowledged result landed, against Ductor's rule."""
        if self.result_partitions is None:
            topic = self.producer.list_topics(self.results_topic, timeout=10).topics[self.results_topic]
            self.result_partitions = len(topic.partitions)
        expected = contract.murmur2_partition(pending.key.encode(), self.result_partitions)
        if pending.partition != expected:
            self.off_contract(
                f"result of {pending.key}",
                ValueError(f"on partition {pending.partition}, murmur2 gives {expected}"),
            )

    def acknowledge(self, round_: Round) -> bool:
        """Waits until the broker has acknowledged every result of the
        round, producing again those it refused, with backoff; False if the
        worker is stopping first."""
        backoff = PUBLISH_RETRY_MIN_S
        while True:
            self.producer.flush()
            failed = [p for p in round_.pending if not p.delivered]
            if not failed:
                if self.strict:
                    for pending in round_.pending:
                        self.check_partition(pending)
                return True
            if self.stopping:
                return False
            log.warning("%d results not acknowledged (%s), retrying", len(failed), failed[0].error)
            time.sleep(backoff)
            backoff = min(backoff * 2, PUBLISH_RETRY_MAX_S)
            for pending in failed:
                pending.error = None
                self.produce(pending)

    def commit(self, round_: Round) -> None:
        offsets = [TopicPartition(t, p, o) for (t, p), o in round_.positions.items()]
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except Exception as e:
            # The group moved on (a rebalance): the partitions' new owner
            # reads these dispatches again, and their results are duplicates
            # the coordinator ignores.
            log.warning("offsets not committed, the dispatches may be redelivered: %s", e)

    def run(self) -> None:
        self.consumer.subscribe([self.steps_topic])
        log.info("worker subscribed to %s", self.steps_topic)
        while not self.stopping:
            messages = self.consumer.consume(num_messages=MAX_BATCH, timeout=POLL_S)
            round_ = Round()
            for msg in messages:
                if msg.error():
                    log.warning("kafka consumer error: %s", msg.error())
                    continue
                step = self.admit(msg)
                if step is not None:
                    pending = self.answer(step, msg.headers())
                    self.produce(pending)
                    round_.pending.append(pending)
                round_.positions[(msg.topic(), msg.partition())] = msg.offset() + 1
            if not round_.positions:
                continue
            if not self.acknowledge(round_):
                log.warning("stopping with results unacknowledged; their dispatches will be redelivered")
                break
            self.commit(round_)
            self.answered += len(round_.pending)
        self.consumer.close()
        log.info("worker stopped after answering %d dispatches", self.answered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="default", help="the pool whose dispatches to answer")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("EXAMPLE_DATABASE_URL"),
        help="the payments ledger's Postgres (default $EXAMPLE_DATABASE_URL)",
    )
    parser.add_argument("--group", help="consumer group (default: the pool's, as Ductor names it)")
    parser.add_argument("--instance-id", help="group.instance.id, for static membership")
    parser.add_argument("--session-timeout-ms", type=int, default=10_000)
    parser.add_argument("--delivery-timeout-ms", type=int, default=60_000)
    parser.add_argument("--strict", action="store_true", help="exit on any message off the contract")
    parser.add_argument("--crash-after-charges", type=int, help="SIGKILL itself after this many new charges")
    args = parser.parse_args()
    if not args.database_url:
        parser.error("--database-url (or EXAMPLE_DATABASE_URL) is required")
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = Worker(args)

    def stop(signum: int, _frame: Any) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()


if __name__ == "__main__":
    main()
