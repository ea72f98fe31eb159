#!/usr/bin/env python3
"""s3:// token shards against the same shards on local disk (issue 36): a cold epoch (empty
cache, every byte from the store), a warm one (the node's cache holds the set), and the
daemon's CPU per GB/s, each an epoch consumed by gpufeedctl (a C++ consumer) from one gpufeedd.
The store is moto's S3 server on loopback (tests/testing/moto_s3_server.py, a Python server):
its own speed bounds the cold rate here, not the network's. Prints a table and a JSON line.

    tests/bench/s3_bench.py [--mib 256] [--shards 8] [--seq-len 2048] [--batch 16]

Needs moto (tests/run.sh puts it in build/s3-venv, or $GPUFEED_S3_PYTHON), gpufeedd and
gpufeedctl from build/ (or $GPUFEEDD, $GPUFEEDCTL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
GPUFEEDD = os.environ.get("GPUFEEDD", str(REPO / "build/server/gpufeedd"))
GPUFEEDCTL = os.environ.get("GPUFEEDCTL", str(REPO / "build/client/ctl/gpufeedctl"))
MOTO_PYTHON = os.environ.get("GPUFEED_S3_PYTHON", str(REPO / "build/s3-venv/bin/python3"))
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m[1]) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of uint16 tokens")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="gpufeedd --threads")
    p.add_argument("--latency-ms", type=int, default=0,
                   help="added to every request by tests/testing/s3_fault_proxy.py between "
                        "gpufeedd and the store (a remote store's first-byte latency)")
    args = p.parse_args()
    if subprocess.run([MOTO_PYTHON, "-c", "import moto.server"], capture_output=True).returncode:
        print(f"no moto at {MOTO_PYTHON}: run tests/run.sh once, or set GPUFEED_S3_PYTHON",
              file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="gpufeed-s3-bench-"))
    moto = daemon = proxy = None
    try:
        local = work / "tokens"
        local.mkdir()
        rng = np.random.default_rng(36)
        per = args.mib * 2**20 // 2 // args.shards
        for k in range(args.shards):
            rng.integers(0, 50000, size=per, dtype=np.uint16).tofile(local / f"shard_{k:03d}.bin")
        total = sum(f.stat().st_size for f in local.iterdir())

        moto = subprocess.Popen([MOTO_PYTHON, str(REPO / "tests/testing/moto_s3_server.py")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(moto.stdout.readline())
        endpoint = f"http://127.0.0.1:{hello['port']}"

        def command(**op):
            moto.stdin.write(json.dumps(op) + "\n")
            moto.stdin.flush()
            answer = moto.stdout.readline().strip()
            assert answer.startswith("ok"), answer

        command(op="create_bucket", bucket="bench")
        for f in sorted(local.iterdir()):
            command(op="put", bucket="bench", key=f"tokens/{f.name}", file=str(f))

        if args.latency_ms > 0:
            proxy = subprocess.Popen(
                [sys.executable, str(REPO / "tests/testing/s3_fault_proxy.py"), "--upstream",
                 endpoint.removeprefix("http://"), "--latency_ms", str(args.latency_ms)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            endpoint = f"http://127.0.0.1:{json.loads(proxy.stdout.readline())['port']}"
        sock = work / "gf.sock"
        with socket_port() as port:
            pass
        daemon = subprocess.Popen(
            [GPUFEEDD, f"--listen=unix://{sock}", f"--threads={args.threads}",
             f"--s3_endpoint={endpoint}", f"--cache_bytes={2 * total + (64 << 20)}",
             f"--metrics_listen=127.0.0.1:{port}"], stderr=subprocess.DEVNULL)
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        env = dict(os.environ, AWS_ACCESS_KEY_ID=hello["access_key"],
                   AWS_SECRET_ACCESS_KEY=hello["secret"], AWS_ENDPOINT_URL_S3=endpoint,
                   HOME=str(work))
        for name in [n for n in env if n.startswith("AWS_") and n not in (
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3")]:
            del env[name]

        def epoch(dataset: str, job: str, epochs: int = 1) -> dict:
            cpu0, rx0 = cpu_seconds(daemon.pid), metric(port, "gpufeed_s3_received_bytes_total")
            t0 = time.perf_counter()
            out = subprocess.run(
                [GPUFEEDCTL, "--socket", str(sock), "consume", "--dataset", dataset, "--job", job,
                 "--token-dtype", "uint16", "--seq-len", str(args.seq_len), "--batch-size",
                 str(args.batch), "--seed", "1", "--epochs", str(epochs)],
                capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise SystemExit(f"gpufeedctl consume {dataset}: {out.stderr}")
            seconds = time.perf_counter() - t0
            return {"seconds": seconds, "mb_per_s": epochs * total / seconds / 1e6,
                    "cpu_s": cpu_seconds(daemon.pid) - cpu0,
                    "remote_bytes": metric(port, "gpufeed_s3_received_bytes_total") - rx0}

        # The store alone: every shard fetched by boto3 (4 threads) from the same server, the
        # rate no client of it can beat here (moto is Python, on this machine's cores too).
        store_script = (
            "import boto3, json, sys, time\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "a = json.loads(sys.argv[1])\n"
            "s3 = boto3.client('s3', endpoint_url=a['endpoint'], region_name='us-east-1',\n"
            "                  aws_access_key_id=a['key'], aws_secret_access_key=a['secret'])\n"
            "objs = s3.list_objects_v2(Bucket='bench', Prefix='tokens/')['Contents']\n"
            "B = 8 << 20\n"
            "out = {}\n"
            "for name, jobs in (('whole', [(o['Key'], None) for o in objs]),\n"
            "                   ('ranges', [(o['Key'], a) for o in objs for a in range(0, o['Size'], B)])):\n"
            "    t0 = time.perf_counter()\n"
            "    get = lambda j: len(s3.get_object(Bucket='bench', Key=j[0], **({} if j[1] is None else\n"
            "        {'Range': f'bytes={j[1]}-{j[1] + B - 1}'}))['Body'].read())\n"
            "    with ThreadPoolExecutor(4) as pool:\n"
            "        n = sum(pool.map(get, jobs))\n"
            "    out[name] = {'bytes': n, 'seconds': time.perf_counter() - t0}\n"
            "print(json.dumps(out))\n")
        out = subprocess.run([MOTO_PYTHON, "-c", store_script, json.dumps(
            {"endpoint": endpoint, "key": hello["access_key"], "secret": hello["secret"]})],
            capture_output=True, text=True, check=True)
        store = json.loads(out.stdout.strip().splitlines()[-1])
        store_run, store_ranges = (
            {"seconds": r["seconds"], "mb_per_s": r["bytes"] / r["seconds"] / 1e6,
             "cpu_s": float("nan"), "remote_bytes": float(r["bytes"])}
            for r in (store["whole"], store["ranges"]))
        local_run = epoch(str(local), "local")
        # Two epochs in one session: the first cold, the second from the cache. Measured as
        # one run of 2 epochs minus a run of the first alone would hide the cache's effect on
        # the first; so: a cold session of one epoch, then a second session of one epoch (a
        # new feed, the node's cache already full).
        cold = epoch("s3://bench/tokens/", "cold")
        warm = epoch("s3://bench/tokens/", "warm")
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
        for child in (proxy, moto):
            if child is not None:
                child.stdin.close()
                child.wait()
        shutil.rmtree(work, ignore_errors=True)

    rows = [("local disk (page cache)", local_run),
            ("the store alone (boto3, 4 threads, whole objects)", store_run),
            ("the store alone (boto3, 4 threads, 8 MiB ranges: the cache's blocks)", store_ranges),
            ("s3, cold (every byte from the store)", cold),
            ("s3, warm (the node's cache)", warm)]
    print(f"\n{total / 2**20:.0f} MiB of uint16 tokens in {args.shards} shards, seq_len "
          f"{args.seq_len}, B={args.batch}, one epoch each by gpufeedctl consume; moto on "
          f"loopback{f', {args.latency_ms} ms added a request' if args.latency_ms else ''}; "
          f"gpufeedd --threads {args.threads}; {os.cpu_count()} cores")
    print("| epoch | MB/s | vs local | daemon CPU s per GB | bytes from the store |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        cpu = "-" if r["cpu_s"] != r["cpu_s"] else f"{r['cpu_s'] / (total / 1e9):.2f}"
        print(f"| {name} | {r['mb_per_s']:,.0f} | {r['mb_per_s'] / local_run['mb_per_s']:.0%} | "
              f"{cpu} | {r['remote_bytes']:,.0f} |")
    print(json.dumps({"bench": "s3", "bytes": total, "latency_ms": args.latency_ms,
                      "store_alone": store_run, "store_alone_ranges": store_ranges,
                      "cold_vs_store_ranges": cold["mb_per_s"] / store_ranges["mb_per_s"], "local": local_run, "cold": cold,
                      "warm": warm, "cold_vs_local": cold["mb_per_s"] / local_run["mb_per_s"],
                      "warm_remote_bytes": warm["remote_bytes"]}))
    return 0


class socket_port:
    """A free TCP port on loopback (bound, then released for the daemon)."""

    def __enter__(self) -> int:
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


if __name__ == "__main__":
    sys.exit(main())
