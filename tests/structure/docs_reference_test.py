#!/usr/bin/env python3
"""The reference pages of docs/reference/ against the code they describe, and README's links.

    docs_reference_test.py ROOT GPUFEEDD GPUFEEDCTL

- flags.md: every flag of `gpufeedd --help` has a row, every row's flag exists, and every
  field of config.proto's messages has a row (as `--name`, `--base` of a `base_ms` field,
  or `name` for a field without a flag);
- metrics.md: exactly the families of tests/deploy/metrics.txt (which metrics_test.py holds
  the running daemon to), one row each;
- gpufeedctl.md: a heading for every command of `gpufeedctl --help`, and every option of
  every command (`gpufeedctl COMMAND --help`) and of gpufeedctl itself;
- protocol.md: every service, rpc and message of proto/gpufeed/v1/*.proto;
- c-api.md: every function of <gpufeed/gpufeed.h>; python-api.md: every argument of
  gpufeed.torch.Loader and gpufeed.Client.attach;
- README.md links every page under docs/, and no relative link of README.md, docs/ or
  client/python/README.md points at a missing file.

Each problem is one line naming the page and the missing item; exit 1 if any. Before it checks
the real pages, each check is run on a page with one item taken out and must report exactly
that item (a check that cannot fail is a defect).
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
from typing import Callable, List, Set

ROOT = pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else pathlib.Path(".")
REF = "docs/reference"


def read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def run(*command: str) -> str:
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def table_first_cells(page: str) -> List[str]:
    """The first cell of every table row (header and separator rows left out)."""
    cells = []
    for line in page.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*:?-", line):
            cells.append(line.split("|")[1])
    return cells


# ---- gpufeedd flags and config.proto ----------------------------------------------------

def help_flags(help_text: str) -> Set[str]:
    return set(re.findall(r"^ {4}--(\w+) \(", help_text, re.M))


def page_flags(page: str) -> Set[str]:
    return {f for cell in table_first_cells(page) for f in re.findall(r"`--(\w+)`", cell)}


def config_fields(proto: str) -> Set[str]:
    """Scalar fields of every message of config.proto (a field of a message type defined there
    is a group of settings, not a setting)."""
    messages = set(re.findall(r"^\s*message (\w+)", proto, re.M))
    fields = set()
    for kind, name in re.findall(r"^\s*(?:repeated |optional )?([\w.]+) (\w+) = \d+", proto, re.M):
        if kind not in messages:
            fields.add(name)
    return fields


def check_flags(page: str, help_text: str, proto: str) -> List[str]:
    where = f"{REF}/flags.md"
    flags, listed = help_flags(help_text), page_flags(page)
    problems = [f"{where}: no row for --{f} (gpufeedd --help has it)" for f in sorted(flags - listed)]
    problems += [f"{where}: a row for --{f}, which gpufeedd --help does not have"
                 for f in sorted(listed - flags)]
    named = {n for cell in table_first_cells(page) for n in re.findall(r"`(?:--)?(\w+)`", cell)}
    for field in sorted(config_fields(proto)):
        base = field[:-3] if field.endswith("_ms") else field
        if field not in named and base not in named:
            problems.append(f"{where}: no row for config.proto's field {field}")
    return problems


# ---- metrics ------------------------------------------------------------------------------

def check_metrics(page: str, families: Set[str]) -> List[str]:
    where = f"{REF}/metrics.md"
    listed = {m for cell in table_first_cells(page) for m in re.findall(r"`(gpufeed_\w+)`", cell)}
    return ([f"{where}: no row for {m} (tests/deploy/metrics.txt)" for m in sorted(families - listed)]
            + [f"{where}: a row for {m}, which tests/deploy/metrics.txt does not list"
               for m in sorted(listed - families)])


# ---- gpufeedctl ---------------------------------------------------------------------------

def ctl_commands(help_text: str) -> List[str]:
    section = help_text.split("Commands:", 1)[1] if "Commands:" in help_text else ""
    return re.findall(r"^([a-z][a-z-]*)$", section, re.M)


def ctl_options(help_text: str) -> Set[str]:
    return set(re.findall(r"^\s+(?:-\w,)?(--[a-z][a-z-]*)", help_text, re.M)) - {"--help"}


def check_gpufeedctl(page: str, main_help: str, command_help: dict) -> List[str]:
    where = f"{REF}/gpufeedctl.md"
    problems = []
    headings = re.findall(r"^#+ (.*)$", page, re.M)
    for command in ctl_commands(main_help):
        if not any(re.search(rf"`{command}`", h) for h in headings):
            problems.append(f"{where}: no heading for the command {command}")
    options = {("", o) for o in ctl_options(main_help.split("Commands:", 1)[0])}
    options |= {(c + " ", o) for c, text in command_help.items() for o in ctl_options(text)}
    for command, option in sorted(options):
        if not re.search(rf"`{option}\b", page):
            problems.append(f"{where}: gpufeedctl {command}{option} is not described")
    return problems


# ---- protocol, C API, Python API -----------------------------------------------------------

def proto_names(proto: str) -> Set[str]:
    return set(re.findall(r"^\s*(?:service|rpc|message|enum) (\w+)", proto, re.M))


def check_names(page: str, names: Set[str], where: str, what: str) -> List[str]:
    spans = re.findall(r"`([^`\n]+)`", page)  # code spans, paired in order
    return [f"{where}: {what} {n} is not described" for n in sorted(names)
            if not any(re.search(rf"\b{n}\b", span) for span in spans)]


def c_functions(header: str) -> Set[str]:
    return set(re.findall(r"^[A-Za-z_][\w *]*?\b(gpufeed_\w+)\(", header, re.M))


def python_arguments(source: str, cls: str, method: str) -> Set[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}
    raise AssertionError(f"no {cls}.{method}")


def check_python(page: str, loader: Set[str], attach: Set[str]) -> List[str]:
    where = f"{REF}/python-api.md"
    problems = []
    for what, names in (("gpufeed.torch.Loader", loader), ("gpufeed.Client.attach", attach)):
        match = re.search(rf"\b{what.rsplit('.', 1)[1]}\(([^`]*)\)`", page)
        given = set(re.findall(r"(\w+)(?:=|,|\))", match.group(1) + ")")) if match else set()
        problems += [f"{where}: {what}'s argument {n} is not in its signature there"
                     for n in sorted(names - given)]
    return problems


# ---- links ----------------------------------------------------------------------------------

def check_links(readme: str, pages: dict) -> List[str]:
    problems = []
    linked = {m for m in re.findall(r"\]\((docs/[^)#\s]+\.md)", readme)}
    for rel in sorted(pages):
        if rel.startswith("docs/") and rel not in linked:
            problems.append(f"README.md: no link to {rel}")
    for rel, text in sorted(pages.items()):
        base = (ROOT / rel).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            file, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", file):
                continue
            path = base / file if file else ROOT / rel
            if not path.exists():
                problems.append(f"{rel}: link to {target}, which does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                problems.append(f"{rel}: link to {target}, whose page has no such heading")
    return problems


def anchors(page: str) -> Set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks)."""
    page = re.sub(r"^```.*?^```", "", page, flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page, re.M)}


# ---- a check must be able to fail ---------------------------------------------------------

def expect(check: Callable[[str], List[str]], page: str, item: str, want: str) -> List[str]:
    """``check`` on ``page`` without ``item`` must report ``want``."""
    got = check(page.replace(item, "`removed`"))
    return [] if want in got else [f"self-check: without {item} the check said {got}, not {want!r}"]


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    gpufeedd, gpufeedctl = sys.argv[2], sys.argv[3]
    sys.path.insert(0, str(ROOT / "tests" / "deploy"))
    import metrics_contract  # noqa: E402  (tests/deploy, the metrics' one list)

    gpufeedd_help = run(gpufeedd, "--help")
    config_proto = read("proto/gpufeed/v1/config.proto")
    ctl_help = run(gpufeedctl, "--help")
    command_help = {c: run(gpufeedctl, c, "--help") for c in ctl_commands(ctl_help)}
    wire = "\n".join(p.read_text() for p in sorted((ROOT / "proto/gpufeed/v1").glob("*.proto"))
                     if p.name != "config.proto")
    families = set(metrics_contract.load())
    functions = c_functions(read("client/c/include/gpufeed/gpufeed.h"))
    loader_args = python_arguments(read("client/python/src/gpufeed/torch.py"), "Loader", "__init__")
    attach_args = python_arguments(read("client/python/src/gpufeed/client.py"), "Client", "attach")
    for name, found in (("gpufeedd --help flags", help_flags(gpufeedd_help)),
                        ("gpufeedctl commands", ctl_commands(ctl_help)),
                        ("metrics", families), ("proto names", proto_names(wire)),
                        ("C functions", functions), ("Loader arguments", loader_args)):
        if len(found) < 3:
            print(f"FAIL: found only {sorted(found)} as {name}: the parsing no longer fits")
            return 1

    pages = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
             for p in sorted((ROOT / "docs").rglob("*.md"))}
    pages["README.md"] = read("README.md")
    pages["client/python/README.md"] = read("client/python/README.md")
    ref = {name: pages.get(f"{REF}/{name}.md", "") for name in
           ("flags", "metrics", "gpufeedctl", "protocol", "c-api", "python-api")}
    checks = {
        "flags": lambda p: check_flags(p, gpufeedd_help, config_proto),
        "metrics": lambda p: check_metrics(p, families),
        "gpufeedctl": lambda p: check_gpufeedctl(p, ctl_help, command_help),
        "protocol": lambda p: check_names(p, proto_names(wire), f"{REF}/protocol.md",
                                          "proto name"),
        "c-api": lambda p: check_names(p, functions, f"{REF}/c-api.md", "function"),
        "python-api": lambda p: check_python(p, loader_args, attach_args),
    }

    flag, metric, fn = sorted(help_flags(gpufeedd_help))[0], sorted(families)[0], sorted(functions)[0]
    problems = expect(checks["flags"], ref["flags"], f"`--{flag}`",
                      f"{REF}/flags.md: no row for --{flag} (gpufeedd --help has it)")
    problems += expect(checks["metrics"], ref["metrics"], f"`{metric}`",
                       f"{REF}/metrics.md: no row for {metric} (tests/deploy/metrics.txt)")
    problems += expect(checks["gpufeedctl"], ref["gpufeedctl"], "`--reconnect-timeout",
                       f"{REF}/gpufeedctl.md: gpufeedctl consume --reconnect-timeout is not "
                       "described")
    problems += expect(checks["gpufeedctl"], ref["gpufeedctl"], "`drain`",
                       f"{REF}/gpufeedctl.md: no heading for the command drain")
    problems += expect(checks["protocol"], ref["protocol"], "Feed.Attach",
                       f"{REF}/protocol.md: proto name Attach is not described")
    problems += expect(checks["c-api"], ref["c-api"], fn,
                       f"{REF}/c-api.md: function {fn} is not described")
    problems += expect(checks["python-api"], ref["python-api"], "keepalive=None",
                       f"{REF}/python-api.md: gpufeed.torch.Loader's argument keepalive is not in "
                       "its signature there")
    problems += expect(lambda r: check_links(r, pages), pages["README.md"], "docs/benchmarks.md",
                       "README.md: no link to docs/benchmarks.md")
    if problems:
        print("\n".join("FAIL: " + p for p in problems))
        return 1

    for name, check in checks.items():
        problems += check(ref[name])
    problems += check_links(pages["README.md"], pages)
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"ok: {len(help_flags(gpufeedd_help))} flags, {len(families)} metrics, "
              f"{len(command_help)} gpufeedctl commands, {len(proto_names(wire))} proto names, "
              f"{len(functions)} C functions, {len(loader_args)} Loader arguments, "
              f"{len(pages)} pages linked")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
