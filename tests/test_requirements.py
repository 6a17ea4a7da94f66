"""`bash dev.sh demo|test` installs requirements-dev.txt into a fresh venv of whatever Python the
user has; the project claims Python 3.8-3.11. This resolves the file (`pip install --dry-run
--ignore-installed`, nothing installed) for every claimed Python found on this machine, so a pin
without a Python marker cannot silently break the set-up commands on an older Python again.

Pythons are looked for as `python3.X` on PATH and in pyenv's versions folder; GNMX_PYTHONS
(space-separated interpreter paths) overrides the search. Each resolve needs the package index.
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIMED = ("3.8", "3.9", "3.10", "3.11")  # = dev.sh, setup.py's python_requires, docs/install.md
_TIMEOUT_S = 600


def find_python(version):
    """An interpreter of `version` ("3.X") on this machine, or None."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python3")))
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    return None


def _pythons():
    given = os.environ.get("GNMX_PYTHONS")
    if given:
        return [(exe, exe) for exe in given.split()]
    return [(v, find_python(v)) for v in CLAIMED]


def resolve(exe):
    """(returncode, output) of resolving requirements-dev.txt for interpreter `exe`."""
    cmd = [exe, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "-r", os.path.join(ROOT, "requirements-dev.txt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def resolutions():
    """All resolves at once (each is mostly waiting on the index)."""
    found = [(name, exe) for name, exe in _pythons() if exe]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(found))) as pool:
        futures = {name: pool.submit(resolve, exe) for name, exe in found}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name,exe", _pythons(), ids=[n for n, _ in _pythons()])
def test_requirements_resolve(name, exe, resolutions):
    if exe is None:
        pytest.skip(f"no Python {name} on this machine (looked for python{name} on PATH and in "
                    "pyenv's versions)")
    code, out = resolutions[name]
    if code != 0 and ("pip install --dry-run" in out and "no such option" in out):
        pytest.skip(f"pip of {exe} is older than 22.2 (no --dry-run)")
    assert code == 0, f"requirements-dev.txt does not resolve on Python {name} ({exe}):\n{out[-3000:]}"


def test_claimed_pythons_match_setup_py():
    """One list of claimed Pythons: this test's, setup.py's python_requires and its classifiers."""
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    minor = [int(v.split(".")[1]) for v in CLAIMED]
    assert f'python_requires=">={CLAIMED[0]},<3.{minor[-1] + 1}"' in setup
    for v in CLAIMED:
        assert f"Programming Language :: Python :: {v}" in setup, v
