"""The examples under client/python/examples, run for a few steps on the CPU."""

from __future__ import annotations

import json
import os
import socket as socketlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import ROOT  # noqa: E402

# Runs a script with torchvision unimportable (installed or not): an import of it, or of its
# transforms or datasets, raises ImportError.
_WITHOUT_TORCHVISION = """
import runpy, sys
for name in ("torchvision", "torchvision.transforms", "torchvision.datasets"):
    sys.modules[name] = None
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_ddp_with_gpufeed_needs_no_torchvision(daemon, job, datasets, tmp_path):
    pipeline = tmp_path / "pipeline.json"
    pipeline.write_text(json.dumps({"ops": [
        {"random_resized_crop": {"size": 4, "scale_min": 0.5, "scale_max": 1.0,
                                 "ratio_min": 0.75, "ratio_max": 1.3333333}},
        {"flip": {"p": 0.5}},
        {"normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}]}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               TORCHELASTIC_RUN_ID=job)
    script = ROOT / "client" / "python" / "examples" / "train_ddp.py"
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCHVISION, str(script), "--data", str(datasets.images),
         "--loader", "gpufeed", "--device", "cpu", "--arch", "tiny", "--batch-size", "2",
         "--image-size", "4", "--steps", "3", "--warmup", "1", "--no-bf16",
         "--pipeline", str(pipeline), "--socket", daemon.socket, "--json"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("gpufeed: tiny, 1 rank(s) x batch 2, 3 steps after 1 warm-up: ")
    result = json.loads(lines[1])
    assert (result["loader"], result["arch"], result["steps"]) == ("gpufeed", "tiny", 3)


def test_train_tokens_passes_its_vocab_to_the_loader(daemon, tmp_path):
    """train_tokens.py gives the loader its --vocab as vocab_size, so a file whose
    tokens reach the vocabulary is refused at attach, naming vocab_size (it used to reach the
    model's embedding: an index error, or silent nonsense with a wider vocabulary)."""
    script = ROOT / "client" / "python" / "examples" / "train_tokens.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    data = tmp_path / "tokens.bin"
    base = [sys.executable, str(script), "--socket", daemon.socket, "--device", "cpu",
            "--steps", "2", "--seq-len", "16", "--batch-size", "4"]
    made = subprocess.run(base + ["--make-data", str(data), "--vocab", "512"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert "2 steps in " in made.stdout
    small = subprocess.run(base + ["--data", str(data), "--vocab", "100"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert small.returncode == 1
    assert small.stderr.startswith("gpufeed: InvalidArgument: attach: "), small.stderr
    assert "vocab_size" in small.stderr and "100" in small.stderr, small.stderr
