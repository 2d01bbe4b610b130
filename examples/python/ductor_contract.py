"""Ductor's message contract, for Python clients: names, keys, signatures,
and the committed JSON Schemas.

In: the environment Ductor itself reads (``KAFKA_BOOTSTRAP_SERVERS``,
``DUCTOR__KAFKA__TOPIC_PREFIX``, ``DUCTOR__KAFKA__GROUP_ID``,
``DUCTOR__SIGNATURES__TENANT_KEYS__<TENANT>``) and the schema files under
``schemas/`` (``messages/<type>.json``, ``headers/<set>.json``).
Out: topic and group names, the key and headers of an input, the
``ductor-signature`` of a tenant's input, and verdicts of messages and
header sets against their schemas.
Guarantees: one place spells every wire name the examples use; schemas are
the committed files, read once, with the ``$ref`` between files resolved
through one registry; formats (``uuid``, ``date-time``) are checked, not
only shapes. Nothing here talks to Kafka or Postgres.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Mapping

import jsonschema
import referencing
import referencing.jsonschema

# ---------------------------------------------------------------------------
# Names on the wire (Ductor's src/contract/names.rs and headers.rs).

SCHEMA_VERSION = 1

# Headers of every effect Ductor publishes.
IDEMPOTENCY_KEY = "idempotency-key"
RUN_ID = "ductor-run-id"
SEQ = "ductor-seq"
TENANT = "ductor-tenant"
CE_TIME = "ce_time"
CE_TYPE = "ce_type"
CONTENT_TYPE = "content-type"
JSON_CONTENT = "application/json"
# The header that carries a tenant's signature on an input.
SIGNATURE = "ductor-signature"
# W3C Trace Context, on effects and inputs alike (and on HTTP requests).
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# Bounds the coordinator holds an input to (src/contract/input.rs and the
# default configuration): a result over them is dead-lettered, so a worker
# reports a failure that says why instead.
MAX_ERROR_MESSAGE_LEN = 4096
MAX_INPUT_BYTES = 1_032_192
# A dispatch published later than this after its transition committed has
# its deadline counted from its record's timestamp (src/contract/effects.rs).
LATE_DISPATCH_MS = 1_000


@dataclass(frozen=True)
class Topics:
    """The topics of one deployment, under ``kafka.topic_prefix``."""

    prefix: str = "ductor."

    @property
    def requests(self) -> str:
        return f"{self.prefix}requests"

    @property
    def wakeups(self) -> str:
        return f"{self.prefix}wakeups"

    @property
    def attempt_results(self) -> str:
        return f"{self.prefix}attempt-results"

    @property
    def events(self) -> str:
        return f"{self.prefix}events"

    def steps(self, pool: str) -> str:
        return f"{self.prefix}steps.{pool}"


def env_topics() -> Topics:
    return Topics(os.environ.get("DUCTOR__KAFKA__TOPIC_PREFIX", "ductor."))


def env_bootstrap_servers() -> str:
    return os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


def worker_group(pool: str) -> str:
    """The consumer group of a pool's workers, as Ductor's Rust worker
    library names it: every worker of a pool, in any language, shares it."""
    coordinator_group = os.environ.get("DUCTOR__KAFKA__GROUP_ID", "ductor-coordinator")
    return f"{coordinator_group}-worker-{pool}"


def step_key(run_id: str, step_index: int) -> str:
    """The key of one step of one run, the same for every attempt of it."""
    return f"{run_id}/step/{step_index}"


def input_key(run_id: str) -> str:
    """The Kafka key of an input: its run. Every input of a run must land
    on partition ``murmur2(key) % partitions`` of its topic, which the
    producer's ``partitioner = murmur2_random`` gives (see
    :data:`PRODUCER_SETTINGS`)."""
    return run_id


# The producer settings an input producer needs: the Java client's
# partitioner (Ductor's rule for where a run's inputs land), and delivery
# reports that mean the record is in the log.
PRODUCER_SETTINGS: Mapping[str, str] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": "true",
    "acks": "all",
    "max.in.flight.requests.per.connection": "1",
    "linger.ms": "2",
    "compression.type": "lz4",
}


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition the Java client (and librdkafka's ``murmur2_random``)
    gives a non-empty key: Kafka's murmur2, its sign bit cleared, modulo the
    partition count. For checking where records landed; producers let the
    client pick."""
    m, r = 0x5BD1E995, 24
    length = len(key)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(key[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = key[whole:]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


# ---------------------------------------------------------------------------
# Signatures (src/contract/signature.rs).

TENANT_KEY_PREFIX = "DUCTOR__SIGNATURES__TENANT_KEYS__"


def env_tenant_keys() -> dict[str, bytes]:
    """Each tenant's signing key from the variables Ductor reads,
    ``DUCTOR__SIGNATURES__TENANT_KEYS__<TENANT>``; Ductor lower-cases the
    name, and so does this."""
    return {
        name[len(TENANT_KEY_PREFIX) :].lower(): value.encode()
        for name, value in os.environ.items()
        if name.startswith(TENANT_KEY_PREFIX) and value
    }


def sign(key: bytes, payload: bytes, signed_at_ms: int | None = None) -> str:
    """The ``ductor-signature`` of a tenant's input: ``t=<unix ms>,v2=<hex
    HMAC-SHA256 of "<t>." and the value>``. The coordinator refuses one made
    more than ``signatures.max_age_ms`` from when the record reached Kafka."""
    if signed_at_ms is None:
        signed_at_ms = time.time_ns() // 1_000_000
    mac = hmac.new(key, f"{signed_at_ms}.".encode(), hashlib.sha256)
    mac.update(payload)
    return f"t={signed_at_ms},v2={mac.hexdigest()}"


# ---------------------------------------------------------------------------
# Messages: the step dispatch a worker reads, the result it writes.


class OffContract(Exception):
    """A message or a set of headers that its schema refuses."""


@dataclass(frozen=True)
class StepDispatch:
    run_id: str
    tenant: str
    workflow: str
    workflow_version: int
    step: str
    step_index: int
    attempt: int
    step_key: str
    stamp: str
    deadline: datetime
    input: Any

    @staticmethod
    def from_json(value: Mapping[str, Any]) -> "StepDispatch":
        """Decodes a ``step.dispatch`` (validate it first); a dispatch
        committed before steps had keys gets its key derived the same way
        Ductor derives it."""
        if value.get("type") != "step.dispatch" or value.get("schema_version") != SCHEMA_VERSION:
            raise OffContract(f"not a step.dispatch of schema version {SCHEMA_VERSION}")
        run_id, index = value["run_id"], int(value["step_index"])
        return StepDispatch(
            run_id=run_id,
            tenant=value["tenant"],
            workflow=value["workflow"],
            workflow_version=int(value["workflow_version"]),
            step=value["step"],
            step_index=index,
            attempt=int(value["attempt"]),
            step_key=value.get("step_key") or step_key(run_id, index),
            stamp=value["stamp"],
            deadline=parse_time(value["deadline"]),
            input=value.get("input"),
        )


# ---------------------------------------------------------------------------
# Trace context: a worker continues the trace of the dispatch it answers.

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def new_traceparent(sampled: bool = True) -> str:
    """A ``traceparent`` that starts a trace of its own."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a well-formed ``traceparent``, else None (W3C: version
    ``ff`` and all-zero ids are invalid; a version 00 value has no suffix)."""
    m = _TRACEPARENT.match(traceparent or "")
    if m is None:
        return None
    version, trace, span, _, rest = m.groups()
    if version == "ff" or trace == "0" * 32 or span == "0" * 16 or (version == "00" and rest):
        return None
    return trace


def continue_trace(headers: Iterable[tuple[str, bytes | None]] | None) -> list[tuple[str, bytes]]:
    """The trace headers of a result that continues ``headers``' trace: the
    same trace id and flags under a span id of the result's own, and the
    ``tracestate`` as it came. None when the dispatch carries no valid trace:
    an untraced run stays untraced."""
    parent = header(headers, TRACEPARENT)
    trace = trace_id(parent)
    if parent is None or trace is None:
        return []
    flags = parent[53:55]
    out = [(TRACEPARENT, f"00-{trace}-{secrets.token_hex(8)}-{flags}".encode())]
    state = header(headers, TRACESTATE)
    if state:
        out.append((TRACESTATE, state.encode()))
    return out


def parse_time(text: str) -> datetime:
    # Python before 3.11 does not take a trailing "Z".
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def dispatch_delay(record_ms: int | None, ce_time: str | None) -> timedelta:
    """How late a dispatch was published: its record's timestamp past its
    ``ce_time`` when that exceeds :data:`LATE_DISPATCH_MS`, else zero."""
    if record_ms is None or not ce_time:
        return timedelta(0)
    try:
        committed_ms = int(parse_time(ce_time).timestamp() * 1000)
    except ValueError:
        return timedelta(0)
    late = record_ms - committed_ms
    return timedelta(milliseconds=late) if late > LATE_DISPATCH_MS else timedelta(0)


def result_succeeded(step: StepDispatch, output: Any) -> dict[str, Any]:
    return {
        "type": "attempt.result",
        "schema_version": SCHEMA_VERSION,
        "run_id": step.run_id,
        "tenant": step.tenant,
        "stamp": step.stamp,
        "outcome": "succeeded",
        "output": output,
    }


def result_failed(step: StepDispatch, message: str, retryable: bool) -> dict[str, Any]:
    return {
        "type": "attempt.result",
        "schema_version": SCHEMA_VERSION,
        "run_id": step.run_id,
        "tenant": step.tenant,
        "stamp": step.stamp,
        "outcome": "failed",
        "error": {"message": message[:MAX_ERROR_MESSAGE_LEN], "retryable": retryable},
    }


def encode(value: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and infinities are refused (not JSON)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def encode_result(step: StepDispatch, result: dict[str, Any]) -> bytes:
    """The bytes of ``result``, or of a non-retryable failure that says why
    when the coordinator would refuse them (not encodable as JSON, or over
    its input limit): the step then fails at once instead of timing out
    behind a dead letter."""
    try:
        payload = encode(result)
    except (ValueError, TypeError, UnicodeEncodeError) as e:
        why = f"the step's result is not JSON: {e}"
    else:
        if len(payload) <= MAX_INPUT_BYTES:
            return payload
        why = f"the step's result is {len(payload)} bytes, over {MAX_INPUT_BYTES}"
    return encode(result_failed(step, why, retryable=False))


# ---------------------------------------------------------------------------
# The committed schemas.


def default_schemas_dir() -> Path:
    """``$DUCTOR_SCHEMAS_DIR``, else the repository's ``schemas/`` two
    levels above this file."""
    named = os.environ.get("DUCTOR_SCHEMAS_DIR")
    return Path(named) if named else Path(__file__).resolve().parents[2] / "schemas"


class Schemas:
    """Every schema under a directory, by message type and by header set,
    in one registry so that a ``$ref`` from one file to another resolves
    (by the files' own URIs, or a schema's ``$id``)."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = (directory or default_schemas_dir()).resolve()
        files = sorted(directory.glob("messages/*.json")) + sorted(directory.glob("headers/*.json"))
        if not files:
            raise FileNotFoundError(f"no schemas under {directory}")
        resources = []
        self._uris: dict[tuple[str, str], str] = {}
        for path in files:
            contents = json.loads(path.read_text(encoding="utf-8"))
            resource = referencing.Resource.from_contents(
                contents, default_specification=referencing.jsonschema.DRAFT202012
            )
            uri = path.as_uri()
            resources.append((uri, resource))
            self._uris[(path.parent.name, path.name[: -len(".json")])] = uri
        self._registry = referencing.Registry().with_resources(resources).crawl()
        self._validators: dict[str, jsonschema.protocols.Validator] = {}

    def _validator(self, kind: str, name: str) -> jsonschema.protocols.Validator:
        uri = self._uris.get((kind, name))
        if uri is None:
            raise OffContract(f"no schema {kind}/{name}.json")
        validator = self._validators.get(uri)
        if validator is None:
            validator = jsonschema.Draft202012Validator(
                {"$ref": uri},
                registry=self._registry,
                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
            )
            self._validators[uri] = validator
        return validator

    def _check(self, kind: str, name: str, value: Any) -> None:
        error = jsonschema.exceptions.best_match(self._validator(kind, name).iter_errors(value))
        if error is not None:
            path = "/" + "/".join(str(p) for p in error.absolute_path)
            raise OffContract(f"{kind}/{name}.json: {error.message[:300]} at {path}")

    def check_message(self, value: Any) -> None:
        """Checks a message against the schema of its ``type``."""
        kind = value.get("type") if isinstance(value, dict) else None
        self._check("messages", str(kind), value)

    def check_headers(self, set_name: str, headers: Iterable[tuple[str, bytes | None]]) -> None:
        """Checks Kafka headers (UTF-8 values) against ``headers/<set>.json``
        (``effect``, ``input`` or ``dead-letter``)."""
        as_object: dict[str, str] = {}
        for name, value in headers:
            try:
                as_object[name] = (value or b"").decode()
            except UnicodeDecodeError:
                raise OffContract(f"header {name} is not UTF-8") from None
        self._check("headers", set_name, as_object)


def header(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> str | None:
    """The first header ``name``, as text."""
    for key, value in headers or ():
        if key == name and value is not None:
            return value.decode(errors="replace")
    return None
