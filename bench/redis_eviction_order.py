#!/usr/bin/env python3
"""Which pages of a prefix survive when Redis runs out of memory (docs/tiers.md, "Redis under
maxmemory").

kvserve writes a prefix's pages head first, each under its own key, and a lookup can use a
prefix only up to its first missing page. When the shared Redis is full, whatever it evicts from
the middle of a prefix makes the rest of it dead weight. This study asks a real redis-server
(--maxmemory, --samples, each of --policies) which keys it keeps when a chain of --pages values of --value-bytes each
(a SmolLM2 f16 page is ~360 KB) arrives in pipelined batches of 16 (the tier's write batch), as
the tier writes them, under four client strategies:

  plain     SET each page (today's writer)
  touch     after each batch, TOUCH every earlier page of the chain, deepest first, the head last
            (the remedy suggested in a user test: refresh the head when the tail is written)
  ttl       SET ... PX ttl, the same TTL for every page (--kv-redis-ttl)
  graded    SET ... PX ttl - depth * --grade-ms: a page deeper in the prefix expires sooner, so a
            volatile-ttl Redis evicts tails before heads

For each policy x strategy, --repeats runs on a fresh server: keys kept, the usable head (pages
0..k-1 all present) and the dead keys (kept past the first gap). JSON on stdout (or --out).

    python3 bench/redis_eviction_order.py                 # 8 MB, 102 pages, 3 repeats
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Resp:
    """A minimal RESP2 client: pipelined commands, replies parsed in order."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b"-"):
            return rest.decode()
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(1 << 20)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise ValueError(f"unexpected reply {line[:40]!r}")

    def pipeline(self, cmds: list[list]) -> list:
        out = bytearray()
        for c in cmds:
            out += b"*%d\r\n" % len(c)
            for a in c:
                a = a if isinstance(a, bytes) else str(a).encode()
                out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return [self._reply() for _ in cmds]


def one_run(redis_bin: str, policy: str, strategy: str, args) -> dict:
    port = free_port()
    d = tempfile.mkdtemp(prefix="redis-order-")
    proc = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", d, "--maxmemory", args.maxmemory, "--maxmemory-policy", policy,
                             "--maxmemory-samples", str(args.samples)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 5
        while True:
            try:
                r = Resp(port)
                if r.pipeline([["PING"]]) == ["PONG"]:
                    break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.02)
        value = os.urandom(args.value_bytes)
        errors = 0
        n = args.pages
        for b in range(0, n, 16):
            cmds = []
            for i in range(b, min(n, b + 16)):
                c = ["SET", f"page:{i}", value]
                if strategy == "ttl":
                    c += ["PX", args.ttl_ms]
                elif strategy == "graded":
                    c += ["PX", args.ttl_ms - i * args.grade_ms]
                cmds.append(c)
            errors += sum(1 for x in r.pipeline(cmds) if isinstance(x, str) and x != "OK")
            if strategy == "touch":
                last = min(n, b + 16) - 1
                r.pipeline([["TOUCH", f"page:{i}"] for i in range(last - 1, -1, -1)])
        present = [x == 1 for x in r.pipeline([["EXISTS", f"page:{i}"] for i in range(n)])]
        usable = next((i for i, p in enumerate(present) if not p), n)
        kept = sum(present)
        return {"kept": kept, "usable": usable, "dead": kept - usable, "write_errors": errors}
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maxmemory", default="8mb")
    ap.add_argument("--pages", type=int, default=102)
    ap.add_argument("--value-bytes", type=int, default=360_000)
    ap.add_argument("--ttl-ms", type=int, default=3_600_000)
    ap.add_argument("--grade-ms", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=5, help="Redis's maxmemory-samples (5: its default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=["allkeys-lru", "allkeys-lfu", "volatile-ttl"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    redis_bin = shutil.which("redis-server")
    if not redis_bin:
        print("redis-server not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    strategies = {"allkeys-lru": ["plain", "touch"], "allkeys-lfu": ["plain", "touch"], "volatile-ttl": ["ttl", "graded"]}
    rows = []
    for policy in args.policies:
        for strategy in strategies.get(policy, ["plain", "touch", "ttl", "graded"]):
            runs = []
            for k in range(args.repeats):
                print(f"{policy} / {strategy}: run {k + 1}/{args.repeats}", file=sys.stderr, flush=True)
                runs.append(one_run(redis_bin, policy, strategy, args))
            rows.append({"policy": policy, "strategy": strategy, "runs": runs,
                         "median_kept": statistics.median(x["kept"] for x in runs),
                         "median_usable": statistics.median(x["usable"] for x in runs)})
    out = {"maxmemory": args.maxmemory, "maxmemory_samples": args.samples, "pages": args.pages, "value_bytes": args.value_bytes,
           "ttl_ms": args.ttl_ms, "grade_ms": args.grade_ms, "results": rows}
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    print("| policy | writer | kept (of %d) | usable head | dead |" % args.pages, file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for row in rows:
        print("| %s | %s | %s | %s | %s |" % (row["policy"], row["strategy"], ", ".join(str(x["kept"]) for x in row["runs"]),
                                           ", ".join(str(x["usable"]) for x in row["runs"]),
                                           ", ".join(str(x["dead"]) for x in row["runs"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
