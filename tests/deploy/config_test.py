#!/usr/bin/env python3
"""Checks the shipped gpufeedd configs: deploy/gpufeedd.textproto and deploy/k8s/gpufeedd.textproto.

    config_test.py REPO_ROOT PROTOC GPUFEEDD GPUFEEDCTL

1. Each parses as gpufeed.v1.DaemonConfig (`protoc --encode`: field names and types).
2. The example, deploy/gpufeedd.textproto, sets and so documents every field of DaemonConfig.
3. The built daemon starts with each (the socket and the TCP ports overridden by flags, which
   also checks that flags override the file), serves, writes logs in the config's format, and
   exits 0 on SIGTERM.

Exit 0 when all holds, 1 with one line per problem.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from typing import List

import daemon_util

CONFIGS = ("deploy/gpufeedd.textproto", "deploy/k8s/gpufeedd.textproto")
problems: List[str] = []


def daemon_config_fields(proto: str) -> List[str]:
    body = re.search(r"message DaemonConfig \{(.*?)\n\}", proto, re.S)
    if not body:
        raise ValueError("config.proto has no message DaemonConfig")
    return re.findall(r"^\s*(?:optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+\s*;", body.group(1), re.M)


def main(argv: List[str]) -> int:
    root, protoc, gpufeedd, gpufeedctl = pathlib.Path(argv[1]), argv[2], argv[3], argv[4]
    proto = root / "proto/gpufeed/v1/config.proto"
    fields = daemon_config_fields(proto.read_text(encoding="utf-8"))
    for relative in CONFIGS:
        path = root / relative
        text = path.read_text(encoding="utf-8")
        run = subprocess.run([protoc, "--encode=gpufeed.v1.DaemonConfig",
                              f"--proto_path={root / 'proto'}", "gpufeed/v1/config.proto"],
                             input=text.encode(), capture_output=True, timeout=60)
        if run.returncode != 0:
            problems.append(f"{relative} is not a gpufeed.v1.DaemonConfig: "
                            f"{run.stderr.decode(errors='replace').strip()}")
            continue
        json_logs = re.search(r'^log_format:\s*"json"', text, re.M) is not None
        try:
            with daemon_util.running(gpufeedd, gpufeedctl,
                                     [f"--config={path}", "--metrics_listen=127.0.0.1:0",
                                      "--health_listen=127.0.0.1:0"]) as daemon:
                status = daemon.ctl("-o", "json", "status")
                if status.returncode != 0:
                    problems.append(f"{relative}: gpufeedctl status failed: {status.stderr}")
                first = daemon.log_text().splitlines()[:1]
                if json_logs:
                    try:
                        json.loads(first[0])
                    except (IndexError, ValueError):
                        problems.append(f"{relative} asks for JSON logs; the first line is "
                                        f"{first}")
        except RuntimeError as e:
            problems.append(f"{relative}: {e}")
    example = (root / CONFIGS[0]).read_text(encoding="utf-8")
    for field in fields:
        if not re.search(rf"^{field}\s*:", example, re.M):
            problems.append(f"{CONFIGS[0]} does not set (and so does not document) {field}")
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"ok: {', '.join(CONFIGS)} parse as DaemonConfig and gpufeedd serves with each; "
              f"the example covers all {len(fields)} fields")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
