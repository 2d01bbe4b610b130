#!/usr/bin/env python3
"""Sets a SCRAM user's password on a running Kafka broker, with no
dependencies beyond Python 3 (the stack's cached jars carry no admin tools).

    scram_user.py --port 9092 --user ductor --password SECRET [--mechanism SCRAM-SHA-512]

scripts/stack runs it once for a cluster formatted before the stack made its
SCRAM user (a new cluster gets the user at format time). It sends one
AlterUserScramCredentials v0 request (KIP-554) to the broker's PLAINTEXT
listener, which forwards it to the controller; setting the same user again
replaces its password. Exit status 0 once the broker reports success.
"""

import argparse
import hashlib
import os
import socket
import struct
import sys

from metadata_probe import ProbeError, exchange, request_header

API_ALTER_USER_SCRAM_CREDENTIALS = 51
# The mechanism's number in the protocol, and its hash.
MECHANISMS = {"SCRAM-SHA-256": (1, "sha256"), "SCRAM-SHA-512": (2, "sha512")}
# Kafka's minimum for both mechanisms.
ITERATIONS = 8192


def uvarint(n):
    out = b""
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def compact_bytes(data):
    return uvarint(len(data) + 1) + data


def alter_request(user, password, mechanism):
    number, digest = MECHANISMS[mechanism]
    salt = os.urandom(32)
    salted = hashlib.pbkdf2_hmac(digest, password.encode(), salt, ITERATIONS)
    out = request_header(API_ALTER_USER_SCRAM_CREDENTIALS, 0, 1, True)
    out += uvarint(1)  # deletions: empty compact array
    out += uvarint(2)  # upsertions: one
    out += compact_bytes(user.encode()) + struct.pack(">bi", number, ITERATIONS)
    out += compact_bytes(salt) + compact_bytes(salted) + b"\x00"
    return out + b"\x00"


def alter(host, port, user, password, mechanism, timeout):
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        body = exchange(sock, alter_request(user, password, mechanism), 1)
    body.skip_tagged_fields()  # response header v1
    body.int32()  # throttle_time_ms
    for _ in range(body.array_len(True)):
        name = body.string(True)
        error = body.int16()
        message = body.string(True, nullable=True)
        body.skip_tagged_fields()
        if error != 0:
            raise ProbeError(f"user {name}: error code {error}: {message}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--user", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--mechanism", default="SCRAM-SHA-512", choices=sorted(MECHANISMS))
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    try:
        alter(args.host, args.port, args.user, args.password, args.mechanism, args.timeout)
    except (OSError, ProbeError) as exc:
        print(f"kafka {args.host}:{args.port}: setting SCRAM user {args.user} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
