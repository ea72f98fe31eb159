#!/usr/bin/env python3
"""A fault-injecting HTTP proxy for S3 tests: it sits between the client under test and an S3
server (tests/testing/moto_s3_server.py) and makes a given share of the exchanges fail the
ways a real store or network does: 500 InternalError and 503 SlowDown answers, added latency,
and bodies cut short (the full Content-Length announced, half the bytes sent, the connection
closed). Standard library only.

Deterministic by seed: whether a request is faulted depends only on the seed, the request
(method, path with query, Range header) and how many times that same request came before, not
on which thread serves it or in what order concurrent requests arrive; so a retry of a faulted
request draws again, and a run with the same seed and requests faults the same ones.

Requests are relayed with their headers unchanged, Host included, so signatures made for the
proxy's address verify at the server.

    s3_fault_proxy.py --upstream 127.0.0.1:PORT [--seed N] [--error_rate F]
                      [--truncate_rate F] [--latency_ms N]

Prints {"port": N} on one line once it listens; exits when stdin closes (the test ended).
"""

import argparse
import hashlib
import http.client
import http.server
import json
import sys
import threading
import time

# Hop-by-hop headers and the framing the proxy sets itself.
DROPPED = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection",
           "te", "trailer", "upgrade"}

ERRORS = [
    (500, "InternalError", "We encountered an internal error. Please try again."),
    (503, "SlowDown", "Please reduce your request rate."),
]


class Faults:
    def __init__(self, seed: int, error_rate: float, truncate_rate: float, latency_ms: int):
        self.seed = seed
        self.error_rate = error_rate
        self.truncate_rate = truncate_rate
        self.latency_ms = latency_ms
        self.lock = threading.Lock()
        self.seen = {}

    def draw(self, request: str):
        """Two numbers in [0, 1) for this request's nth occurrence."""
        with self.lock:
            n = self.seen.get(request, 0)
            self.seen[request] = n + 1
        digest = hashlib.sha256(f"{self.seed}|{request}|{n}".encode()).digest()
        scale = float(1 << 64)
        return (int.from_bytes(digest[:8], "big") / scale,
                int.from_bytes(digest[8:16], "big") / scale)


def make_handler(upstream_host: str, upstream_port: int, faults: Faults):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002  (the base class's name)
            pass  # quiet: a test reads the client's counters, not our log

        def relay(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            request = f"{self.command} {self.path} {self.headers.get('Range', '')}"
            fault, kind = faults.draw(request)
            if faults.latency_ms:
                time.sleep(faults.latency_ms / 1000)
            if fault < faults.error_rate:
                status, code, message = ERRORS[int(kind * len(ERRORS))]
                xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                       f"<Message>{message}</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)
                return

            upstream = http.client.HTTPConnection(upstream_host, upstream_port, timeout=60)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in DROPPED:
                        upstream.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(len(body)))
                upstream.endheaders(body)
                response = upstream.getresponse()
                data = response.read()
                headers = [(k, v) for k, v in response.getheaders() if k.lower() not in DROPPED]
                announced = response.getheader("Content-Length") if self.command == "HEAD" \
                    else str(len(data))
                status = response.status
            finally:
                upstream.close()

            truncate = (fault < faults.error_rate + faults.truncate_rate and len(data) >= 2)
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            if announced is not None:
                self.send_header("Content-Length", announced)
            self.end_headers()
            if truncate:
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = relay

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error_rate", type=float, default=0.0,
                        help="share of requests answered 500 or 503")
    parser.add_argument("--truncate_rate", type=float, default=0.0,
                        help="share of requests whose body is cut in half")
    parser.add_argument("--latency_ms", type=int, default=0, help="added to every request")
    args = parser.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    faults = Faults(args.seed, args.error_rate, args.truncate_rate, args.latency_ms)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             make_handler(host, int(port), faults))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    for _ in sys.stdin:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
