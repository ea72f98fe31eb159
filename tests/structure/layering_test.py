#!/usr/bin/env python3
"""The layering of the source tree, checked on every include and every link between the server's
libraries (docs/ARCHITECTURE.md section 2). The build runs it before it compiles any of them
(server/CMakeLists.txt, gpufeed_layering), so a back-arrow fails the build; ctest runs it too.

Each folder has a layer; a file may include its own folder and folders of lower layers only,
so an include that runs back up (a cycle between folders) fails here, naming the file, the
line and both layers. The core (everything under server/ but service/ and the daemon's own
files) may include neither the wire types (gpufeed/v1/) nor gRPC: it never knows it is served
over gRPC (docs/STYLE.md rule 1). Clients and the daemon share only common/.

Each server folder is one library in server/CMakeLists.txt, gpufeed_<folder> (the daemon's own
files: gpufeed_daemon), built from that folder's sources only. It links exactly the libraries of
the folders it includes: a link that runs back up, a link to a folder it includes nothing of and
an include of a folder it does not link all fail here.

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
    # Object stores (S3): what the reader will read remote shards through.
    ["server/objstore"],
    ["server/auth", "server/reader", "server/staging", "server/sampler", "server/decode",
     "client/cpp"],
    ["server/augment", "server/share", "client/c", "client/ctl"],
    ["server/device", "server/images"],
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


def check_includes(root: str, uses: dict) -> list:
    """The includes that run against the layers. Fills uses: folder -> the folders (and "wire"
    for the wire types) its files include."""
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
                used = uses.setdefault(here, set())
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        include = m.group(1)
                        if include.startswith("gpufeed/v1/"):
                            used.add(WIRE_TYPES)
                        if include.startswith(WIRE) and here.startswith("server") and \
                                here not in CORE_FREE_OF_WIRE:
                            problems.append(f"{path}:{number}: the core ({here}) includes "
                                            f"{include}: only server/service/ knows gRPC")
                            continue
                        there = target_of(include)
                        if not there or there == here:
                            continue
                        used.add(there)
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


# The libraries of server/CMakeLists.txt. gpufeed_<x> is server/<x>'s; these are the others.
BUILD_FILE = "server/CMakeLists.txt"
WIRE_TYPES = "the wire types"
LIBRARY_FOLDER = {
    "gpufeed_daemon": "server", "gpufeedd": "server",  # the daemon's own files, main.cc
    "gpufeed_common": "common", "gpufeed_cuda": "common/cuda",  # from common/CMakeLists.txt
}
LIBRARY_OF = {"common": "gpufeed_common", "common/os": "gpufeed_common",
              "common/cuda": "gpufeed_cuda", "server": "gpufeed_daemon",
              WIRE_TYPES: "gpufeed_proto"}
# What tests and tools link; no library of a folder may.
UMBRELLAS = {"gpufeed_core"}
# Linked by anyone: flags, not code.
UNLAYERED = {"gpufeed_warnings"}
COMMAND = re.compile(r"\b(add_library|add_executable|target_link_libraries|target_sources)\s*\(")
KEYWORDS = {"STATIC", "SHARED", "OBJECT", "INTERFACE", "PUBLIC", "PRIVATE"}


def library_of(folder: str) -> str:
    return LIBRARY_OF.get(folder) or "gpufeed_" + folder.split("/", 1)[1]


def folder_of_library(name: str, server_folders: set) -> str:
    """The folder a library holds, or "" for one of no folder."""
    if name in LIBRARY_FOLDER:
        return LIBRARY_FOLDER[name]
    folder = "server/" + name[len("gpufeed_"):]
    return folder if name.startswith("gpufeed_") and folder in server_folders else ""


def parse_build(text: str) -> list:
    """(command, target, [(word, line)]) for each command that defines a target or adds to its
    sources or links, wherever it stands (an if() branch too). Comments are dropped."""
    text = re.sub(r"#[^\n]*", "", text)
    commands = []
    for m in COMMAND.finditer(text):
        end = text.index(")", m.end())
        line = text.count("\n", 0, m.end()) + 1
        words = []
        for number, chunk in enumerate(text[m.end():end].split("\n"), line):
            words += [(word, number) for word in chunk.split()]
        if words:
            commands.append((m.group(1), words[0][0], words[1:]))
    return commands


def check_links(root: str, uses: dict) -> list:
    """The links between the server's libraries that run against the layers, and the libraries
    whose links are not the folders they include."""
    problems = []
    server_folders = {f for f in RANK if f.startswith("server/")}
    with open(os.path.join(root, BUILD_FILE), encoding="utf-8") as f:
        commands = parse_build(f.read())
    folder_of_target, links = {}, {}
    for command, target, words in commands:
        if command in ("add_library", "add_executable"):
            if target in UMBRELLAS:
                continue
            folder = folder_of_library(target, server_folders)
            if not folder:
                line = words[0][1] if words else "?"
                problems.append(f"{BUILD_FILE}:{line}: {target} is named after no folder of "
                                f"server/ (gpufeed_<folder>, or gpufeed_daemon)")
                continue
            folder_of_target[target] = folder
    for command, target, words in commands:
        if target not in folder_of_target:
            continue
        here = folder_of_target[target]
        if command in ("add_library", "add_executable", "target_sources"):
            for word, line in words:
                if word in KEYWORDS:
                    continue
                source_folder = folder_of("server/" + word)
                if source_folder != here:
                    problems.append(f"{BUILD_FILE}:{line}: {target} ({here}) compiles {word} "
                                    f"of {source_folder}: a library holds its own folder only")
            continue
        for word, line in words:
            if word in KEYWORDS or word in UNLAYERED:
                continue
            if word == "gpufeed_proto" or word.startswith("gRPC::"):
                if here not in CORE_FREE_OF_WIRE:
                    problems.append(f"{BUILD_FILE}:{line}: the core ({target}) links {word}: "
                                    f"only server/service/ knows gRPC")
                    continue
            links.setdefault(target, set()).add(word)
            if not word.startswith("gpufeed_") or word == "gpufeed_proto":
                continue
            if word in UMBRELLAS:
                problems.append(f"{BUILD_FILE}:{line}: {target} links {word}, the tests' "
                                f"umbrella: link the libraries it uses")
                continue
            there = folder_of_library(word, server_folders)
            if not there:
                problems.append(f"{BUILD_FILE}:{line}: {target} links {word}, a library of no "
                                f"folder in {__file__}")
            elif there != here and RANK[there] >= RANK[here]:
                how = "the same layer" if RANK[there] == RANK[here] else "a higher layer"
                problems.append(
                    f"{BUILD_FILE}:{line}: {target} ({here}, layer {RANK[here]}) links {word} "
                    f"of {there}, {how} ({RANK[there]}): a link may only run down")
    # The folder's own library links exactly what the folder includes.
    for folder in sorted(server_folders | {"server"}):
        library = library_of(folder)
        if folder not in uses:
            continue
        if folder_of_target.get(library) != folder:
            problems.append(f"{BUILD_FILE}: {folder} has no library {library}")
            continue
        needed = {library_of(there) for there in uses[folder] if there in LIBRARY_OF
                  or there.startswith("server/")}
        linked = {word for word in links.get(library, ())
                  if word.startswith("gpufeed_") and word not in UMBRELLAS}
        for missing in sorted(needed - linked):
            what = sorted(there for there in uses[folder] if library_of(there) == missing)
            problems.append(f"{BUILD_FILE}: {library} does not link {missing}, yet {folder} "
                            f"includes {' and '.join(what)}")
        for extra in sorted(linked - needed):
            problems.append(f"{BUILD_FILE}: {library} links {extra}, yet {folder} includes "
                            f"nothing of it")
    return problems


def check(root: str) -> list:
    uses = {}
    problems = check_includes(root, uses)
    return problems + check_links(root, uses)


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    problems = check(os.path.abspath(root))
    for p in problems:
        print(p)
    if problems:
        print(f"layering: {len(problems)} includes or links run against the layers")
        return 1
    print(f"layering: every include and every link runs down ({len(RANK)} folders in "
          f"{len(LAYERS)} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
