#!/usr/bin/env python3
"""The layering of the source tree, checked on every include (docs/ARCHITECTURE.md section 2).

Each folder has a layer; a file may include its own folder and folders of lower layers only,
so an include that runs back up (a cycle between folders) fails here, naming the file, the
line and both layers. The core (everything under server/ but service/ and the daemon's own
files) may include neither the wire types (gpufeed/v1/) nor gRPC: it never knows it is served
over gRPC (docs/STYLE.md rule 1). Clients and the daemon share only common/.

A new folder must be given a layer here (the test fails on an unknown one).

    python3 tests/structure/layering_test.py [ROOT]
"""

import os
import re
import sys

# Lower layers first. Folders of one layer may not include each other.
LAYERS = [
    # The client's public headers (client/cpp/include/gpufeed/, installed): self-contained.
    ["client/include"],
    ["common"],
    ["common/os", "common/cuda"],
    ["server/auth", "server/reader", "server/staging", "server/sampler", "server/decode",
     "client/cpp"],
    ["server/augment", "server/share", "client/c", "client/ctl"],
    ["server/device", "server/pipeline"],
    ["server/feed"],
    ["server/session"],
    ["server/service"],
    ["server"],  # the daemon: main, config, daemon
]
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}
SOURCES = (".h", ".cc", ".cu", ".c")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
# What the core may not include: the wire types and gRPC.
WIRE = ("gpufeed/v1/", "grpc/", "grpcpp/", "grpc++/")
CORE_FREE_OF_WIRE = {"server/service", "server"}


def folder_of(path: str) -> str:
    """The layered folder of a repo-relative path: its first two components (common/os,
    server/feed), or the top folder for a file directly in it (server/main.cc: server)."""
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def target_of(include: str) -> str:
    """The folder an include names, or "" for a third-party or generated header."""
    if include.startswith("gpufeed/") and not include.startswith("gpufeed/v1/"):
        return "client/include"  # the client's public headers (client/cpp/include/gpufeed/)
    if include.split("/")[0] in ("common", "server", "client"):
        return folder_of(include)
    return ""


def check(root: str) -> list:
    problems = []
    for top in ("common", "server", "client"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.relpath(os.path.join(directory, name), root)
                if path.startswith("client/python/"):
                    continue
                if path.startswith("client/cpp/include/"):
                    here = "client/include"
                else:
                    here = folder_of(path)
                if here not in RANK:
                    problems.append(f"{path}: folder {here} has no layer in {__file__}")
                    continue
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        include = m.group(1)
                        if include.startswith(WIRE) and here.startswith("server") and \
                                here not in CORE_FREE_OF_WIRE:
                            problems.append(f"{path}:{number}: the core ({here}) includes "
                                            f"{include}: only server/service/ knows gRPC")
                            continue
                        there = target_of(include)
                        if not there or there == here:
                            continue
                        if there not in RANK:
                            problems.append(f"{path}:{number}: {include}: folder {there} has "
                                            f"no layer in {__file__}")
                        elif RANK[there] >= RANK[here]:
                            how = "the same layer" if RANK[there] == RANK[here] else "a higher layer"
                            problems.append(
                                f"{path}:{number}: {here} (layer {RANK[here]}) includes {include}"
                                f" of {there}, {how} ({RANK[there]}): an include may only run "
                                f"down (move what both need below them)")
    return problems


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    problems = check(os.path.abspath(root))
    for p in problems:
        print(p)
    if problems:
        print(f"layering: {len(problems)} includes run against the layers")
        return 1
    print(f"layering: every include runs down ({len(RANK)} folders in {len(LAYERS)} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
