"""The wheels on an older distribution, for real: Debian bullseye (glibc 2.31, Python 3.9).

Runs only when asked: GNMX_BULLSEYE=1 (root needed: debootstrap, chroot, mounts; docs/install.md says
how long it takes). tools/bullseye_root.sh makes the root once (build/bullseye/root, or
GNMX_BULLSEYE_ROOT), from Debian's package registry: python3, python3-venv, libgomp1, libquadmath0 and
nothing else. For each wheel, a venv inside it (bullseye's own python3) gets only mxnet==1.9.1,
numpy<1.24 and `pip install` of the wheel (pip itself must accept the tag), then the same smoke as
tests/test_wheel.py runs there: every op forward/backward against numpy, export and reload in a
fresh process, build_info(), a forked DataLoader worker, the README quickstart.
  - cpu: the CPU wheel tests/test_wheel.py builds (tools/build_wheel.sh --cpu);
  - cuda: the CPU+CUDA 11.8 wheel from GNMX_BULLSEYE_CUDA_WHEEL or wheelhouse/cuda/ (built by
    tools/build_wheel.sh; skipped when there is none). No GPU here: its CUDA code stays dormant, the
    CPU ops must run as from the CPU wheel.
"""
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from test_wheel import (check_build_info, check_every_op, check_export_and_reload,
                        check_forked_loader, check_quickstart, wheel)  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.skipif(os.environ.get("GNMX_BULLSEYE") != "1",
                       reason="the bullseye proof runs when GNMX_BULLSEYE=1 (~10 min, root)"),
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                       reason="needs root on Linux (debootstrap, chroot, mount)"),
]

BULLSEYE_GLIBC = "2.31"
BULLSEYE_PYTHON = "3.9"


@pytest.fixture(scope="module")
def bullseye_root():
    root = os.environ.get("GNMX_BULLSEYE_ROOT") or os.path.join(ROOT, "build", "bullseye", "root")
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "bullseye_root.sh"), root],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout.strip()


@contextlib.contextmanager
def _mounted(root):
    """/proc (bound) and a /dev/shm (tmpfs, for the DataLoader's shared memory) while in use."""
    done = []
    try:
        for target, cmd in (("proc", ["mount", "--bind", "/proc"]),
                            ("dev/shm", ["mount", "-t", "tmpfs", "gnmx-shm"])):
            path = os.path.join(root, target)
            os.makedirs(path, exist_ok=True)
            subprocess.run(cmd + [path], check=True)
            done.append(path)
        yield
    finally:
        for path in reversed(done):
            subprocess.run(["umount", "-l", path], check=False)


def _cuda_wheel():
    given = os.environ.get("GNMX_BULLSEYE_CUDA_WHEEL")
    if given:
        return given
    found = glob.glob(os.path.join(ROOT, "wheelhouse", "cuda", "gn_mx-*.whl"))
    return found[0] if len(found) == 1 else None


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def bullseye(request, bullseye_root):
    """(kind, run, work): a venv in the bullseye root with only mxnet, numpy and that wheel."""
    kind = request.param
    # The CPU wheel fixture only when used: `-k cuda` needs no CPU wheel build.
    whl = request.getfixturevalue("wheel") if kind == "cpu" else _cuda_wheel()
    if whl is None:
        pytest.skip("no CUDA wheel: bash tools/build_wheel.sh (or GNMX_BULLSEYE_CUDA_WHEEL=...)")
    root = bullseye_root
    inside = f"/opt/gnmx-{kind}"
    host_dir = root + inside
    shutil.rmtree(host_dir, ignore_errors=True)
    os.makedirs(os.path.join(host_dir, "wheels"))
    os.makedirs(os.path.join(host_dir, "work", "model"))
    shutil.copy(whl, os.path.join(host_dir, "wheels"))
    env = {"PATH": f"{inside}/venv/bin:/usr/bin:/bin", "HOME": f"{inside}/work", "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "2"}

    chroot_bin = shutil.which("chroot") or "/usr/sbin/chroot"  # looked up on the host's PATH

    def chroot(*cmd, timeout=900):
        return subprocess.run([chroot_bin, root, "/usr/bin/env", "-C", f"{inside}/work", *cmd],
                              capture_output=True, text=True, env=env, timeout=timeout)

    with _mounted(root):
        r = chroot("/usr/bin/python3", "-c", "import platform, sys; "
                   "print(platform.libc_ver()[1], '%d.%d' % sys.version_info[:2])")
        assert r.returncode == 0 and r.stdout.split() == [BULLSEYE_GLIBC, BULLSEYE_PYTHON], \
            (r.stdout, r.stderr[-2000:])
        r = chroot("/usr/bin/python3", "-m", "venv", f"{inside}/venv")
        assert r.returncode == 0, r.stderr[-4000:]
        pip = [f"{inside}/venv/bin/python", "-m", "pip", "install", "-q",
               "--disable-pip-version-check"]
        r = chroot(*pip, "mxnet==1.9.1", "numpy<1.24")
        assert r.returncode == 0, r.stderr[-4000:]
        # The wheel alone, by pip's own tag check (no --force, no --no-deps needed: it has none).
        r = chroot(*pip, f"{inside}/wheels/{os.path.basename(whl)}")
        assert r.returncode == 0, r.stderr[-4000:]
        r = chroot(f"{inside}/venv/bin/python", "-m", "pip", "list", "--format=freeze",
                   "--disable-pip-version-check")
        names = {line.split("==")[0].lower() for line in r.stdout.split()}
        assert {"gn-mx", "mxnet", "numpy"} <= names, r.stdout

        def run(code, *args):
            return chroot(f"{inside}/venv/bin/python", "-c", textwrap.dedent(code), *args,
                          timeout=600)

        yield kind, run, f"{inside}/work"


def test_bullseye_every_op(bullseye):
    check_every_op(bullseye[1])


def test_bullseye_export_and_reload_in_a_fresh_process(bullseye):
    kind, run, work = bullseye
    check_export_and_reload(run, f"{work}/model")


def test_bullseye_build_info(bullseye):
    kind, run, _ = bullseye
    info = check_build_info(run, cuda=kind == "cuda")
    if kind == "cuda":
        assert info["cuda"]["sass"] and info["cuda"]["ptx"], info


def test_bullseye_forked_loader_after_an_op_call(bullseye):
    check_forked_loader(bullseye[1])


def test_bullseye_runs_the_quickstart(bullseye):
    check_quickstart(bullseye[1])
