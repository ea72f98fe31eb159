#!/usr/bin/env python3
"""Checks that the running daemon exports exactly the metrics of metrics.txt, the list the
Grafana dashboard and the README are held to.

    metrics_test.py GPUFEEDD GPUFEEDCTL

Starts gpufeedd with --metrics_listen on a loopback port, attaches one consumer (gpufeedctl
consume on a small token file) so that the per-consumer families have samples, scrapes
/metrics, and compares: the gpufeed_* families and their types equal metrics.txt, and every
sample's label names equal its family's. Twice: by default (the per-consumer series show
neither the job's name nor its uid, only an opaque job id), and with --metrics_job_labels
(the name and the uid, metrics.txt's `uid?`). Exit 0 when all holds, 1 with one line per
problem.
"""

from __future__ import annotations

import array
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Set

import daemon_util
import metrics_contract

JOB = "deploy-test"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def main(argv: List[str]) -> int:
    gpufeedd, gpufeedctl = argv[1], argv[2]
    contract = metrics_contract.load()
    series = metrics_contract.by_series_name(contract)
    problems: List[str] = []
    text = scrape_with_consumer(gpufeedd, gpufeedctl, problems, [])
    compare(text, contract, series, problems, with_opt_in=False)
    if JOB in text or f'uid="{os.geteuid()}"' in text:
        problems.append("by default /metrics shows the consumer's job name or uid: "
                        + "; ".join(l for l in text.splitlines() if JOB in l or 'uid="' in l))
    if not re.search(r'^gpufeed_consumer_wall_seconds_total\{job="job-[0-9a-f]{16}",rank="0"\}',
                     text, re.M):
        problems.append("by default the per-consumer series have no opaque job id")
    labelled = scrape_with_consumer(gpufeedd, gpufeedctl, problems, ["--metrics_job_labels"])
    compare(labelled, contract, series, problems, with_opt_in=True)
    if f'gpufeed_consumer_wall_seconds_total{{job="{JOB}",rank="0",uid="{os.geteuid()}"}}' \
            not in labelled:
        problems.append("with --metrics_job_labels the consumer's series lack its job and uid")
    for p in problems:
        print("FAIL:", p)
    if not problems:
        unseen = sorted(n for n in contract if f"\n{n}" not in text)
        print(f"ok: gpufeedd exports the {len(contract)} families of metrics.txt with their "
              f"types; labels checked on every family with samples (none here: {unseen})")
    return 1 if problems else 0


def scrape_with_consumer(gpufeedd: str, gpufeedctl: str, problems: List[str],
                         flags: List[str]) -> str:
    """/metrics of a daemon serving one consumer ("" if it did not start)."""
    port = free_port()
    text = ""
    with tempfile.TemporaryDirectory(prefix="gpufeed-metrics-") as tmp:
        dataset = pathlib.Path(tmp) / "tokens.bin"
        with open(dataset, "wb") as f:
            array.array("H", (k % 50257 for k in range(200_001))).tofile(f)
        try:
            with daemon_util.running(gpufeedd, gpufeedctl,
                                     [f"--metrics_listen=127.0.0.1:{port}",
                                      f"--staging_bytes={64 << 20}", *flags]) as daemon:
                consumer = subprocess.Popen(
                    [gpufeedctl, "--socket", str(daemon.socket), "consume", "--job", JOB,
                     "--rank", "0", "--world-size", "1", "--dataset", str(dataset),
                     "--token-dtype", "uint16", "--seq-len", "16", "--batch-size", "4",
                     "--epochs", "1000", "--step-ms", "20", "--max-batches", "500"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                try:
                    deadline = time.monotonic() + 15
                    text = scrape(port)
                    while ("gpufeed_consumer_wall_seconds_total{" not in text
                           or "gpufeed_batches_produced_total{" not in text):
                        if consumer.poll() is not None or time.monotonic() > deadline:
                            why = consumer.stderr.read() if consumer.poll() is not None else ""
                            problems.append("no per-consumer samples while a consumer ran "
                                            f"(consumer exit {consumer.poll()}: {why})")
                            break
                        time.sleep(0.1)
                        text = scrape(port)
                finally:
                    consumer.terminate()
                    consumer.wait(timeout=10)
        except RuntimeError as e:  # it did not start, or did not exit 0
            problems.append(str(e))
    return text


def compare(text: str, contract: Dict[str, metrics_contract.Family],
            series: Dict[str, metrics_contract.Family], problems: List[str],
            with_opt_in: bool) -> None:
    types: Dict[str, str] = {}
    labels: Dict[str, Set[frozenset]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE gpufeed_"):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line.startswith("gpufeed_"):
            match = SAMPLE.match(line)
            names = frozenset(LABEL.findall(match.group(2) or ""))
            family = series.get(match.group(1))
            if family is None:
                continue  # reported below, by its # TYPE line
            if match.group(1).endswith("_bucket"):
                names -= {"le"}
            labels.setdefault(family.name, set()).add(names)
    for name in sorted(set(types) - set(contract)):
        problems.append(f"the daemon exports {name}, which metrics.txt does not list")
    for name in sorted(set(contract) - set(types)):
        problems.append(f"metrics.txt lists {name}, which the daemon does not export")
    for name in sorted(set(types) & set(contract)):
        if types[name] != contract[name].type:
            problems.append(f"{name} is a {types[name]}, metrics.txt says {contract[name].type}")
        family = contract[name]
        want = family.labels if with_opt_in else family.labels - family.optional
        for names in labels.get(name, ()):
            if names != want:
                problems.append(f"{name} has labels {sorted(names)}, metrics.txt says "
                                f"{sorted(want)} {'with' if with_opt_in else 'without'} "
                                "--metrics_job_labels")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
