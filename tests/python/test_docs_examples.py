"""Every ```python, ```bash and ```sh block of README.md, client/python/README.md and the pages
under docs/ runs as written, against a real gpufeedd and the demo data set.

The markdown's conventions, which this test enforces:

- ``<!-- not-run: REASON -->`` on the line before a fence: the block cannot run here (a GPU,
  root and systemd, a container registry, a build, this test suite itself); the test skips
  it, saying REASON. Every other block runs, and fails the test if it exits non-zero.
- ``<!-- continues -->`` on the line before a fence: the block goes on from the previous
  block of the same file (the same Python process or shell: its names are defined there).
- The examples read the demo data set that ``python3 -m gpufeed.demo`` writes to
  ``/tmp/gpufeed-demo`` and talk to the gpufeedd of ``GPUFEED_SOCKET`` (else the default
  socket). Here ``/tmp/gpufeed-demo`` is replaced by a temporary directory holding the same
  data set (so parallel runs never share it), ``GPUFEED_SOCKET`` names the tests' gpufeedd,
  ``PATH`` finds the built ``gpufeedd`` and ``gpufeedctl`` and this Python as ``python3``, and
  ``PYTHONPATH`` the package's source tree. Python blocks run in a temporary directory, shell
  blocks (``bash -euo pipefail``) in the repository root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest

from conftest import GPUFEEDD, ROOT

# The two READMEs must each show a block that runs; the pages under docs/ run what they have.
TUTORIALS = ("README.md", "client/python/README.md")
DOCS = TUTORIALS + tuple(sorted(p.relative_to(ROOT).as_posix()
                                for p in (ROOT / "docs").rglob("*.md")))
DEMO = "/tmp/gpufeed-demo"
LANGUAGES = ("python", "bash", "sh")
_FENCE = re.compile(r"^( *)```(\S*)\s*$")  # also indented, in a list item
_NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
_CONTINUES = "<!-- continues -->"
_TIMEOUT_S = 60
# Commands a block must not run unmarked: they change the machine (install, systemd, users,
# containers), rebuild, or run this suite. A block using one is refused before it runs, asking
# for a not-run marker, so a doc edit can never make CI install into /usr or recurse.
_UNSAFE = re.compile(r"(^|[\s;&|(])(sudo|apt-get|apt|pip|pip3|systemctl|systemd-sysusers|"
                     r"useradd|usermod|docker|kubectl|cmake|ninja|install|make|"
                     r"tests/run\.sh|\.ci/\S+|deploy/quickstart\.sh|deploy/install-deps\.sh|"
                     r"client/python/build_wheel\.sh)(?=$|[\s;&|)])|-m pytest", re.M)


class Block(NamedTuple):
    doc: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: Optional[str]  # the reason, for a block that is not run
    previous: Optional["Block"]  # the block it continues


def _blocks(doc: str) -> List[Block]:
    """The fenced blocks of the languages above, in order, with their markers."""
    lines = (ROOT / doc).read_text().splitlines()
    out: List[Block] = []
    last: Optional[Block] = None
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        indent, language = len(match[1]), match[2]
        marker = lines[i - 1].strip() if i > 0 else ""
        if language in LANGUAGES:
            not_run = _NOT_RUN.match(marker)
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            block = Block(doc, i + 1, language, code,
                          not_run[1] if not_run else None,
                          last if marker == _CONTINUES else None)
            if marker == _CONTINUES and (last is None or last.language != language):
                raise AssertionError(f"{doc}:{i + 1}: '{_CONTINUES}' follows no {language} "
                                     "block")
            out.append(block)
            last = block
        i = end + 1
    return out


BLOCKS = [block for doc in DOCS for block in _blocks(doc)]


def _chain(block: Block) -> List[Block]:
    """The blocks to run for ``block``: the ones it continues, then itself."""
    chain = [block]
    while chain[0].previous is not None:
        chain.insert(0, chain[0].previous)
    return chain


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory: pytest.TempPathFactory, daemon) -> dict:
    """The environment the blocks run in, and the demo data set written where it says."""
    import gpufeed.demo

    root = tmp_path_factory.mktemp("docs")
    demo = gpufeed.demo.write(str(root / "gpufeed-demo"))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    # A script, not a link: a virtual environment's python linked from elsewhere loses the
    # environment (its pyvenv.cfg is found beside the path it was started by).
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    ctl = (Path(os.environ["GPUFEEDCTL"]).resolve().parent if os.environ.get("GPUFEEDCTL")
           else Path(GPUFEEDD).resolve().parents[1] / "client" / "ctl")
    path = os.pathsep.join([str(bin_dir), str(Path(GPUFEEDD).resolve().parent), str(ctl),
                            os.environ.get("PATH", "")])
    src = str(ROOT / "client" / "python" / "src")
    env = dict(os.environ, GPUFEED_SOCKET=daemon.socket, PATH=path,
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore::UserWarning")  # e.g. torch 1.13 widening uint16
    return {"env": env, "demo": demo, "work": root}


def _id(block: Block) -> str:
    return f"{block.doc}:{block.line}:{block.language}"


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
def test_doc_block_runs(block: Block, demo_env: dict, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"{_id(block)} not run: {block.not_run}")
    chain = _chain(block)
    if block.language != "python":
        unsafe = _UNSAFE.search(block.code)
        assert unsafe is None, (
            f"{_id(block)} runs {unsafe[0].strip()!r}, which changes the machine, builds or "
            "runs the tests: mark it <!-- not-run: REASON --> (the reason is printed)")
    for earlier in chain[:-1]:
        if earlier.not_run is not None:
            pytest.fail(f"{_id(block)} continues {_id(earlier)}, which is not run")
    code = "".join(b.code for b in chain).replace(DEMO, demo_env["demo"])
    if block.language == "python":
        if "torch" in code:
            pytest.importorskip("torch")
        script = tmp_path / "block.py"
        script.write_text(code)
        command, cwd = [sys.executable, str(script)], tmp_path
    else:
        command, cwd = ["bash", "-euo", "pipefail", "-c", code], ROOT
    out = subprocess.run(command, cwd=cwd, env=demo_env["env"], capture_output=True, text=True,
                         timeout=_TIMEOUT_S)
    assert out.returncode == 0, (f"{_id(block)} exited with {out.returncode}:\n{code}\n"
                                 f"--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}")
    print(out.stdout)


def test_every_block_runs_or_says_why() -> None:
    """The census: each doc has runnable blocks, and a block not run says why (an empty or
    malformed marker would hide a block from the test)."""
    for doc in DOCS:
        blocks = [b for b in BLOCKS if b.doc == doc]
        assert doc not in TUTORIALS or any(b.not_run is None for b in blocks), (
            f"{doc}: no block runs")
        text = (ROOT / doc).read_text()
        markers = re.findall(r"<!--\s*not-run[^>]*-->", text)
        assert len(markers) == sum(b.not_run is not None for b in blocks), (
            f"{doc}: a not-run marker that is malformed or before no python/bash/sh fence: "
            f"{markers}")
        assert text.count(_CONTINUES) == sum(b.previous is not None for b in blocks)
    counts = {}
    for b in BLOCKS:
        counts[b.doc, b.not_run is None] = counts.get((b.doc, b.not_run is None), 0) + 1
    print({f"{doc} {'run' if run else 'not run'}": n for (doc, run), n in counts.items()})
