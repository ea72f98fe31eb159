#!/usr/bin/env python3
"""Runs deploy/runtime-packages.sh (the Dockerfile's runtime package list) on the built
binaries and checks it names a package for each library family they link.

    runtime_packages_test.py REPO_ROOT GPUFEEDD GPUFEEDCTL LIBGPUFEED_C

Exit 0 when it holds, 1 with one line per problem.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import List

# Debian 12 and Ubuntu 24.04 names (the latter with the t64 suffix of its 64-bit time_t).
EXPECTED = {
    "grpc++": r"libgrpc\+\+1\.\d+(t64)?",
    "protobuf": r"libprotobuf\d+(t64)?",
    "abseil": r"libabsl\d+(t64)?",
    "spdlog": r"libspdlog1(\.\d+)?(t64)?",
    "libjpeg-turbo": r"libturbojpeg0?",
    "libpng": r"libpng16-16(t64)?",
    "highway": r"libhwy1(t64)?",
    "prometheus-cpp": r"libprometheus-cpp-pull\d.*",
    "libsystemd": r"libsystemd0",
}


def main(argv: List[str]) -> int:
    root, binaries = argv[1], argv[2:]
    run = subprocess.run([f"{root}/deploy/runtime-packages.sh", *binaries],
                         capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        print(f"FAIL: runtime-packages.sh exited {run.returncode}: {run.stderr.strip()}")
        return 1
    packages = run.stdout.split()
    problems = [f"no package for {what} (want /{pattern}/) in {packages}"
                for what, pattern in EXPECTED.items()
                if not any(re.fullmatch(pattern, p) for p in packages)]
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"ok: the runtime image would install {' '.join(packages)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
