#!/usr/bin/env python3
"""Readiness probe for a Kafka broker, with no dependencies beyond Python 3.

An open port only says the socket listener is bound; a broker that answers a
Metadata request with itself in the broker list has finished starting, joined
the KRaft quorum and been unfenced. That is what scripts/stack waits for.

    metadata_probe.py [--host 127.0.0.1] [--port 9092] [--timeout 5] [--quiet]

Exit status: 0 when the response lists at least one broker, 1 otherwise
(connection refused, timeout, error code, malformed or empty response).

Protocol notes. Kafka 4.0 removed many old request versions (KIP-896), so the
probe first sends ApiVersions v0 (still accepted by every broker: clients need
it to discover everything else) and then picks the highest Metadata version in
the broker's range that this file knows how to encode (1..12). Versions 9 and
up use the "flexible" encoding (compact strings/arrays, tagged fields) and the
v2 request / v1 response headers. The Metadata request asks for an empty topic
list, so the response carries the brokers, cluster id and controller only.
"""

import argparse
import socket
import struct
import sys

API_METADATA = 3
API_VERSIONS = 18
CLIENT_ID = b"ductor-metadata-probe"
MAX_METADATA_VERSION = 12


class ProbeError(Exception):
    pass


class Reader:
    """Cursor over a response body; raises ProbeError on truncation."""

    def __init__(self, data):
        self.data = data
        self.pos = 0

    def take(self, n):
        if n < 0 or self.pos + n > len(self.data):
            raise ProbeError("truncated response")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int16(self):
        return struct.unpack(">h", self.take(2))[0]

    def int32(self):
        return struct.unpack(">i", self.take(4))[0]

    def uvarint(self):
        shift = 0
        value = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 35:
                raise ProbeError("malformed varint")

    def string(self, flexible, nullable=False):
        if flexible:
            n = self.uvarint() - 1  # compact: length + 1, 0 means null
        else:
            n = self.int16()
        if n < 0:
            if nullable:
                return None
            raise ProbeError("unexpected null string")
        return self.take(n).decode("utf-8", "replace")

    def array_len(self, flexible):
        n = self.uvarint() - 1 if flexible else self.int32()
        if n < 0:
            raise ProbeError("unexpected null array")
        return n

    def skip_tagged_fields(self):
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.take(self.uvarint())  # size, then the value itself


def request_header(api_key, version, correlation_id, flexible):
    # Request header v1 (non-flexible) and v2 (flexible) both carry the client
    # id as a classic int16-length nullable string; v2 adds empty tagged fields.
    header = struct.pack(">hhih", api_key, version, correlation_id, len(CLIENT_ID))
    header += CLIENT_ID
    if flexible:
        header += b"\x00"
    return header


def exchange(sock, payload, correlation_id):
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    size = struct.unpack(">i", recv_exact(sock, 4))[0]
    if size < 4 or size > 64 * 1024 * 1024:
        raise ProbeError(f"implausible response size {size}")
    body = Reader(recv_exact(sock, size))
    got = body.int32()
    if got != correlation_id:
        raise ProbeError(f"correlation id {got}, expected {correlation_id}")
    return body


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProbeError("connection closed by broker")
        buf += chunk
    return buf


def metadata_range(sock):
    """ApiVersions v0 -> (min, max) supported Metadata versions."""
    body = exchange(sock, request_header(API_VERSIONS, 0, 1, False), 1)
    error = body.int16()
    if error != 0:
        raise ProbeError(f"ApiVersions error code {error}")
    for _ in range(body.array_len(False)):
        key, lo, hi = body.int16(), body.int16(), body.int16()
        if key == API_METADATA:
            return lo, hi
    raise ProbeError("broker does not advertise the Metadata API")


def metadata_request(version):
    flexible = version >= 9
    out = request_header(API_METADATA, version, 2, flexible)
    # topics: an empty (not null) array asks for no topic metadata at all.
    out += b"\x01" if flexible else struct.pack(">i", 0)
    if version >= 4:
        out += b"\x00"  # allow_auto_topic_creation = false
    if 8 <= version <= 10:
        out += b"\x00"  # include_cluster_authorized_operations = false
    if version >= 8:
        out += b"\x00"  # include_topic_authorized_operations = false
    if flexible:
        out += b"\x00"  # no tagged fields
    return out


def parse_metadata(body, version):
    flexible = version >= 9
    if flexible:
        body.skip_tagged_fields()  # response header v1
    if version >= 3:
        body.int32()  # throttle_time_ms
    brokers = []
    for _ in range(body.array_len(flexible)):
        node_id = body.int32()
        host = body.string(flexible)
        port = body.int32()
        body.string(flexible, nullable=True)  # rack
        if flexible:
            body.skip_tagged_fields()
        brokers.append((node_id, host, port))
    cluster_id = body.string(flexible, nullable=True) if version >= 2 else None
    controller_id = body.int32()
    return brokers, cluster_id, controller_id


def probe(host, port, timeout):
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        lo, hi = metadata_range(sock)
        version = min(hi, MAX_METADATA_VERSION)
        if version < max(lo, 1):
            raise ProbeError(f"broker supports Metadata v{lo}..v{hi}, probe knows v1..v{MAX_METADATA_VERSION}")
        body = exchange(sock, metadata_request(version), 2)
        brokers, cluster_id, controller_id = parse_metadata(body, version)
    if not brokers:
        raise ProbeError("metadata response lists no brokers yet")
    return version, brokers, cluster_id, controller_id


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--timeout", type=float, default=5.0, help="socket timeout in seconds")
    parser.add_argument("--quiet", action="store_true", help="print nothing, just set the exit status")
    args = parser.parse_args()
    try:
        version, brokers, cluster_id, controller_id = probe(args.host, args.port, args.timeout)
    except (OSError, ProbeError) as exc:
        if not args.quiet:
            print(f"kafka {args.host}:{args.port} not ready: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        listed = ", ".join(f"{n}@{h}:{p}" for n, h, p in brokers)
        print(f"kafka {args.host}:{args.port} ready: metadata v{version}, brokers [{listed}], "
              f"controller {controller_id}, cluster id {cluster_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
