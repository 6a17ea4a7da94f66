"""gn_mx's real PTX executed on GPGPU-Sim (no GPU): the simulator layer of the GPU tests.

tests/gpu/sim/gpgpusim.sh builds the simulator from GNMX_GPGPUSIM_SRC (a tarball or a clone of
accel-sim/gpgpu-sim_distribution) with the project's fixes (tests/gpu/sim/gpgpusim-fixes.patch),
builds the CUDA kernels + tests/gpu/harness.cc as compute_70 PTX with nvcc 11.8, and runs the list
in tests/gpu/sim/ci_tests.txt (chosen to reach every kernel) in one pytest process on it. Without a
simulator source this test skips and says so; it never passes without running the list. On the
list nothing may skip: a skip there means a kernel went unchecked.
"""
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu", "sim", "gpgpusim.sh")


def test_ci_list_on_gpgpusim(tmp_path):
    src = os.environ.get("GNMX_GPGPUSIM_SRC")
    if not src:
        pytest.skip("no GPGPU-Sim source: set GNMX_GPGPUSIM_SRC to a tarball or clone of "
                    "accel-sim/gpgpu-sim_distribution (tests/gpu/README.md)")
    if not os.path.exists(src):
        pytest.skip(f"GNMX_GPGPUSIM_SRC={src} does not exist")
    junit = tmp_path / "sim.xml"
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", SCRIPT, "ci", "-q", "-rs", f"--junitxml={junit}"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    tail = "\n".join(r.stdout.splitlines()[-60:])
    assert r.returncode == 0, tail
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, (counts, tail)
    assert counts["skipped"] == 0, ("a test of the simulator list skipped", tail)
    print(f"GPGPU-Sim: {counts['tests']} passed in {float(suite.get('time', 0)):.0f} s;",
          " ".join(re.findall(r"\[gpgpusim\] [^\n]* built in \d+ s", r.stdout)))
