#!/usr/bin/env python3
"""A downstream consumer of Ductor's ``run.output`` effects, applied once.

In: the ``run.output`` records of a workflow's output topic, each with its
``idempotency-key`` header. Out: one row per run in the consumer's own
Postgres table ``example_shipments``, and the claimed keys in
``ductor_dedup_seen``, the table of Ductor's Rust helper
``ductor::client::dedup`` (same columns, same claim), so consumers in either
language can share it.
Guarantees: effectively once. Ductor delivers an effect at least once,
always with the same key; the key is claimed in the same transaction that
applies the effect (``INSERT ... ON CONFLICT DO NOTHING``: one row, the
first delivery; none, a duplicate), and the Kafka offset is committed only
after that transaction. A crash between the two is a redelivery, which the
claim turns into a no-op.

    python consumer.py --topic ductor.outputs --database-url postgres://...

``--stop-at-end`` exits once the partitions it was given are read to the
end they had when it started (a replay), printing what it applied and what
it found already applied as one JSON line. ``--crash-after-applied N``
kills it with SIGKILL right after the transaction that applied its N-th
effect committed, before the offset is (for tests of what a crash costs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

import psycopg
from confluent_kafka import Consumer, Message, TopicPartition

import ductor_contract as contract

log = logging.getLogger("consumer")

# Records applied per transaction.
MAX_BATCH = 200
POLL_S = 0.2
# Ductor's dedup helper refuses a consumer name or key longer than this.
MAX_KEY_BYTES = 1024
EXIT_OFF_CONTRACT = 3

# The same table as ductor::client::dedup::SCHEMA_SQL, and the example's own.
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS ductor_dedup_seen (
    consumer text NOT NULL,
    idempotency_key text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, idempotency_key)
);
CREATE INDEX IF NOT EXISTS ductor_dedup_seen_seen_at ON ductor_dedup_seen (seen_at);
CREATE TABLE IF NOT EXISTS example_shipments (
    id bigserial PRIMARY KEY,
    run_id text NOT NULL,
    tenant text NOT NULL,
    workflow text NOT NULL,
    output jsonb NOT NULL,
    idempotency_key text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""
# The lock ductor::client::dedup::ensure_schema takes, so the two never
# create the table at once.
SCHEMA_LOCK_KEY = 0x6475_6374_6F72_6464  # "ductordd"


def claim(db: psycopg.Connection, consumer: str, key: str) -> bool:
    """True if this transaction is the first to see ``key`` for
    ``consumer``: apply the effect in it. False: a committed transaction
    already did."""
    for what, value in (("consumer", consumer), ("idempotency key", key)):
        if not value or len(value.encode()) > MAX_KEY_BYTES:
            raise ValueError(f"{what} must be 1 to {MAX_KEY_BYTES} bytes")
    inserted = db.execute(
        "INSERT INTO ductor_dedup_seen (consumer, idempotency_key) VALUES (%s, %s) "
        "ON CONFLICT (consumer, idempotency_key) DO NOTHING",
        (consumer, key),
    ).rowcount
    return inserted == 1


class OutputConsumer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.name
        self.strict = args.strict
        self.stop_at_end = args.stop_at_end
        self.crash_after = args.crash_after_applied
        self.schemas = contract.Schemas()
        self.db = psycopg.connect(args.database_url)
        with self.db.transaction():
            self.db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            self.db.execute(SCHEMA_SQL)
        settings = {
            "bootstrap.servers": contract.env_bootstrap_servers(),
            "group.id": args.group or f"{args.name}-outputs",
            "client.id": f"py-consumer-{args.name}",
            "enable.auto.commit": "false",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "session.timeout.ms": str(args.session_timeout_ms),
        }
        if args.instance_id:
            settings["group.instance.id"] = args.instance_id
        self.consumer = Consumer(settings)
        self.topic = args.topic
        self.stopping = False
        # With --stop-at-end: each assigned partition's end when assigned.
        self.ends: dict[int, int] = {}
        self.assigned = False
        self.applied = 0
        self.duplicates = 0

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            _, high = consumer.get_watermark_offsets(tp, timeout=10)
            self.ends[tp.partition] = high
        self.assigned = True

    def off_contract(self, what: str, error: Exception) -> None:
        if self.strict:
            log.error("off the contract, stopping: %s: %s", what, error)
            sys.exit(EXIT_OFF_CONTRACT)
        log.warning("off the contract: %s: %s", what, error)

    def apply(self, msg: Message) -> None:
        """Claims the record's key and, the first time, applies it; inside
        the caller's transaction."""
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        headers = msg.headers() or []
        try:
            self.schemas.check_headers("effect", headers)
        except contract.OffContract as e:
            self.off_contract(where, e)
        key = contract.header(headers, contract.IDEMPOTENCY_KEY)
        try:
            value = json.loads(msg.value() or b"")
            self.schemas.check_message(value)
        except (ValueError, contract.OffContract) as e:
            self.off_contract(where, e)
            return
        if not key:
            self.off_contract(where, ValueError(f"no {contract.IDEMPOTENCY_KEY} header"))
            return
        if value.get("type") != "run.output":
            return
        if not claim(self.db, self.name, key):
            self.duplicates += 1
            return
        self.db.execute(
            "INSERT INTO example_shipments (run_id, tenant, workflow, output, idempotency_key) "
            "VALUES (%s, %s, %s, %s, %s)",
            (value["run_id"], value["tenant"], value["workflow"], json.dumps(value["output"]), key),
        )
        self.applied += 1

    def at_end(self) -> bool:
        if not self.assigned:
            return False
        positions = self.consumer.position([TopicPartition(self.topic, p) for p in self.ends])
        return all(
            self.ends[tp.partition] == 0 or tp.offset >= self.ends[tp.partition] for tp in positions
        )

    def run(self) -> None:
        self.consumer.subscribe([self.topic], on_assign=self.on_assign)
        log.info("consumer subscribed to %s", self.topic)
        while not self.stopping:
            if self.stop_at_end and self.at_end():
                break
            messages = self.consumer.consume(num_messages=MAX_BATCH, timeout=POLL_S)
            positions: dict[int, int] = {}
            applied_before = self.applied
            with self.db.transaction():
                for msg in messages:
                    if msg.error():
                        log.warning("kafka consumer error: %s", msg.error())
                        continue
                    self.apply(msg)
                    positions[msg.partition()] = msg.offset() + 1
            if not positions:
                continue
            if self.crash_after is not None and applied_before < self.crash_after <= self.applied:
                log.warning("crashing after applying %d effects, before committing offsets", self.applied)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            offsets = [TopicPartition(self.topic, p, o) for p, o in positions.items()]
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            except Exception as e:
                log.warning("offsets not committed, the records may be redelivered: %s", e)
        self.consumer.close()
        print(json.dumps({"applied": self.applied, "duplicates": self.duplicates}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default=f"{contract.env_topics().prefix}outputs")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("EXAMPLE_DATABASE_URL"),
        help="the consumer's own Postgres (default $EXAMPLE_DATABASE_URL)",
    )
    parser.add_argument("--name", default="shipping", help="the consumer's name in ductor_dedup_seen")
    parser.add_argument("--group", help="consumer group (default <name>-outputs)")
    parser.add_argument("--instance-id", help="group.instance.id, for static membership")
    parser.add_argument("--session-timeout-ms", type=int, default=10_000)
    parser.add_argument("--stop-at-end", action="store_true")
    parser.add_argument("--strict", action="store_true", help="exit on any message off the contract")
    parser.add_argument("--crash-after-applied", type=int)
    args = parser.parse_args()
    if not args.database_url:
        parser.error("--database-url (or EXAMPLE_DATABASE_URL) is required")
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    consumer = OutputConsumer(args)

    def stop(signum: int, _frame: Any) -> None:
        consumer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    consumer.run()


if __name__ == "__main__":
    main()
