"""Rough edges a new user meets: scripts' --help only prints help and writes nothing, shape errors
of the blocks are reported by the block (with the layer's name) also under deferred
initialization, empty batches under the NumPy interface, and the ONNX path prints no library
warnings the user cannot act on."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
from mxnet import gluon, npx

import gn_mx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts():
    found = []
    for top in ("benchmarks", "examples"):
        for p in sorted(glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)):
            if not os.path.basename(p).startswith("_"):  # helper modules, not scripts
                found.append(p)
    return found


def _git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=True).stdout


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")) and
                    not os.path.isfile(os.path.join(ROOT, ".git")), reason="needs a git checkout")
def test_every_script_help_only_prints_help(tmp_path):
    scripts = _scripts()
    assert len(scripts) >= 10, scripts
    before = _git_status()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    # All at once (each mostly waits on imports); run from a scratch directory so a script that
    # writes into its working directory would be caught as well.
    procs = [(p, subprocess.Popen([sys.executable, p, "--help"], cwd=str(tmp_path), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for p in scripts]
    bad = []
    for p, proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            bad.append(f"{p}: --help still running after 120 s")
            continue
        if proc.returncode != 0 or "usage:" not in out:
            bad.append(f"{p}: rc {proc.returncode}, output:\n{out[-800:]}")
    assert not bad, "\n".join(bad)
    assert _git_status() == before, "a script's --help changed the repository"
    assert os.listdir(str(tmp_path)) == [], "a script's --help wrote into the working directory"
