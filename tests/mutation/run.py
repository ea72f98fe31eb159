#!/usr/bin/env python3
"""Mutation testing of gpufeed's core, on demand (too slow for CI on 2 cores).

For each target of tests/mutation/targets.txt, universalmutator (PyPI, installed on first use
into BUILD/mutation-tools) writes mutants of the named functions only; each mutant replaces
the source file in place, the build rebuilds just the affected object and the test binary
(ccache keeps the rest), and the target's tests run. A mutant is *killed* when its tests fail
or time out, *survives* when they pass, and is *invalid* when it does not compile (not
counted). The original file is restored after every mutant, and on Ctrl-C.

  tests/mutation/run.py [--build build] [--only NAME[,NAME]] [--limit N] [--seed S]
                        [--timeout 120] [--json out.json]

Prints one line per mutant as it goes (progress and elapsed time), then a table per target:
mutants, killed, survived, invalid, kill rate, and the surviving mutants as diffs. Exit status
1 when a target named in --require (default: sampler-ranks,staging-pool,release) keeps a
survivor.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_targets(path: Path):
    targets = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 4:
            sys.exit(f"{path}:{n}: want NAME | FILE | FUNCTIONS | TEST, got {line!r}")
        name, file, functions, test = parts
        kind, _, arg = test.partition(":")
        if kind not in ("unit", "pytest"):
            sys.exit(f"{path}:{n}: TEST must start with unit: or pytest:, got {test!r}")
        targets.append(dict(name=name, file=file, functions=functions.split(";"), kind=kind,
                            arg=arg))
    return targets


def function_lines(text: str, patterns, python: bool, where: str):
    """1-based line numbers of the bodies of the functions whose first lines match."""
    lines = text.splitlines()
    wanted = set()
    for pattern in patterns:
        start = next((i for i, l in enumerate(lines) if re.search(pattern, l)), None)
        if start is None:
            sys.exit(f"{where}: no line matches {pattern!r} (targets.txt is out of date)")
        if python:
            indent = len(lines[start]) - len(lines[start].lstrip())
            end = start + 1
            while end < len(lines) and (not lines[end].strip() or
                                        len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
        else:
            end = next((i for i in range(start, len(lines)) if lines[i] == "}"), len(lines) - 1)
        comment = "#" if python else "//"
        wanted.update(i + 1 for i in range(start, end + 1)
                      if lines[i].strip() and not lines[i].strip().startswith(comment))
    return sorted(wanted)


def code_of(text: str, python: bool) -> str:
    """The text without comments (naively: from the comment marker to the line's end)."""
    marker = "#" if python else "//"
    return "\n".join(l.split(marker, 1)[0].rstrip() for l in text.splitlines())


def tools(build: Path) -> Path:
    venv = build / "mutation-tools"
    mutate = venv / "bin" / "mutate"
    if not mutate.exists():
        print(f"installing universalmutator into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        "universalmutator"], check=True)
    return mutate


def make_mutants(mutate: Path, source: Path, lines, work: Path):
    linefile = work / "lines.txt"
    linefile.write_text("\n".join(map(str, lines)) + "\n")
    out = work / "mutants"
    out.mkdir()
    rules = Path(__file__).with_name("python_core.rules" if source.suffix == ".py"
                                     else "cpp_core.rules")
    subprocess.run([str(mutate), str(source), "--only", str(rules), "--noCheck", "--lines",
                    str(linefile),
                    "--mutantDir", str(out)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=work)
    # Mutants that change only a comment (universalmutator mutates trailing ones) are dropped.
    python = source.suffix == ".py"
    code = code_of(source.read_text(), python)
    mutants = [m for m in out.iterdir() if code_of(m.read_text(), python) != code]
    return sorted(mutants, key=lambda p: int(re.search(r"mutant\.(\d+)\.", p.name).group(1)))


def run_tests(target, build: Path, timeout: float) -> str:
    """'killed', 'survived' or 'invalid' for the mutant now in place."""
    if target["kind"] == "unit":
        built = subprocess.run(["ninja", "-C", str(build), "tests/unit/gpufeed_unit_tests"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if built.returncode != 0:
            return "invalid"
        command = [str(build / "tests/unit/gpufeed_unit_tests"), f"--gtest_filter={target['arg']}",
                   "--gtest_brief=1"]
        env = dict(os.environ)
    else:
        try:  # a Python mutant that does not even compile
            compile(Path(ROOT / target["file"]).read_text(), target["file"], "exec")
        except SyntaxError:
            return "invalid"
        command = [sys.executable, "-m", "pytest", *target["arg"].split()]
        env = dict(os.environ, GPUFEEDD=str(build / "server/gpufeedd"),
                   GPUFEED_LIBRARY=str(build / "client/c/libgpufeed_c.so"))
    try:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout, cwd=ROOT, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "killed"
    return "survived" if done.returncode == 0 else "killed"


def diff_of(original: str, mutant: str, file: str) -> str:
    return "".join(l for l in difflib.unified_diff(original.splitlines(True),
                                                    mutant.splitlines(True), file, file, n=0)
                   if l.startswith(("+", "-")) and not l.startswith(("+++", "---")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=str(ROOT / "build"))
    p.add_argument("--targets", default=str(Path(__file__).with_name("targets.txt")))
    p.add_argument("--only", default="", help="comma-separated target names")
    p.add_argument("--limit", type=int, default=0, help="at most N mutants a target (sampled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120, help="seconds a test run may take")
    p.add_argument("--require", default="sampler-ranks,staging-pool,release")
    p.add_argument("--json", default="")
    args = p.parse_args()
    build = Path(args.build).resolve()
    targets = parse_targets(Path(args.targets))
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {t["name"] for t in targets}
        if unknown:
            sys.exit(f"--only: no target {sorted(unknown)}; targets: {[t['name'] for t in targets]}")
        targets = [t for t in targets if t["name"] in names]
    mutate = tools(build)
    # Build once unmutated: every target's tests must pass before a mutant can be judged.
    subprocess.run(["ninja", "-C", str(build)], check=True, stdout=subprocess.DEVNULL)
    results = []
    started = time.monotonic()
    for target in targets:
        source = ROOT / target["file"]
        original = source.read_text()
        if run_tests(target, build, args.timeout) != "survived":
            sys.exit(f"{target['name']}: the tests fail without any mutant; fix them first")
        lines = function_lines(original, target["functions"], source.suffix == ".py",
                               target["file"])
        with tempfile.TemporaryDirectory() as tmp:
            mutants = make_mutants(mutate, source, lines, Path(tmp))
            if args.limit and len(mutants) > args.limit:
                mutants = sorted(random.Random(args.seed).sample(mutants, args.limit))
            row = dict(name=target["name"], file=target["file"], mutants=len(mutants), killed=0,
                       survived=0, invalid=0, survivors=[])
            restore = lambda *_: (source.write_text(original), sys.exit(130))  # noqa: E731
            signal.signal(signal.SIGINT, restore)
            signal.signal(signal.SIGTERM, restore)
            try:
                for i, mutant in enumerate(mutants, 1):
                    text = mutant.read_text()
                    source.write_text(text)
                    verdict = run_tests(target, build, args.timeout)
                    row[verdict] += 1
                    change = diff_of(original, text, target["file"])
                    if verdict == "survived":
                        row["survivors"].append(change)
                    print(f"[{time.monotonic() - started:6.0f} s] {target['name']} {i}/"
                          f"{len(mutants)} {verdict:8} {change.strip().splitlines()[-1][:100] if change else ''}",
                          flush=True)
            finally:
                source.write_text(original)
            # Rebuild the original so the tree is as it was.
            if target["kind"] == "unit":
                subprocess.run(["ninja", "-C", str(build), "tests/unit/gpufeed_unit_tests"],
                               stdout=subprocess.DEVNULL)
        valid = row["killed"] + row["survived"]
        row["kill_rate"] = row["killed"] / valid if valid else None
        results.append(row)

    print(f"\n| target | file | mutants | killed | survived | invalid | kill rate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        rate = "n/a" if r["kill_rate"] is None else f"{100 * r['kill_rate']:.1f} %"
        print(f"| {r['name']} | {r['file']} | {r['mutants']} | {r['killed']} | {r['survived']} | "
              f"{r['invalid']} | {rate} |")
    for r in results:
        for s in r["survivors"]:
            print(f"\nsurvived in {r['name']}:\n{s}", end="")
    summary = {"bench": "mutation", "seconds": round(time.monotonic() - started),
               "targets": [{k: v for k, v in r.items() if k != "survivors"} | {
                   "survivors": len(r["survivors"])} for r in results]}
    print("\n" + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    required = set(args.require.split(",")) if args.require else set()
    return 1 if any(r["survived"] for r in results if r["name"] in required) else 0


if __name__ == "__main__":
    sys.exit(main())
