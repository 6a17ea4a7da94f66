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


# Kernels the simulator list cannot run, each with the reason (tests/gpu/sim/ci_tests.txt's header
# says more). Every other __global__ function of the CUDA sources must be launched by the list.
NOT_ON_SIM = {}


def cuda_kernels():
    """Names of every __global__ function in the CUDA sources (src/operator/kernels/cuda_sources.txt
    and the headers they include)."""
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    with open(os.path.join(kdir, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    files = [n for n in names if n] + [n for n in os.listdir(kdir) if n.endswith(".cuh")]
    decl = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?"
                      r"(?:void\s+)?(\w+)\s*\(")
    found = set()
    for n in files:
        with open(os.path.join(kdir, n)) as f:
            found |= set(decl.findall(f.read()))
    return found


def launched(log_text, kernels):
    """The kernels among `kernels` that the simulator launched: its "executing kernel <mangled
    name>" lines (functional mode), matched by the Itanium ABI's length-prefixed name."""
    mangled = set(re.findall(r"executing kernel (\S+?)\.\.\.", log_text))
    return {k for k in kernels if any(f"{len(k)}{k}" in m for m in mangled)}


def test_kernel_names_are_found():
    kernels = cuda_kernels()
    assert {"stats_kernel", "iternorm_kernel", "nsc_merge_kernel", "gram_reduce_kernel",
            "affine_grad_kernel", "param_finalize_kernel"} <= kernels and len(kernels) >= 30
    log = ("GPGPU-Sim: Performing Functional Simulation, executing kernel "
           "_ZN5gn_mx12_GLOBAL__N_115iternorm_kernelIdfEEvNS0_8IterArgsIT_EENS0_9IterStageEii...\n")
    assert launched(log, kernels) == {"iternorm_kernel"}


def sim_source():
    """GNMX_GPGPUSIM_SRC, or a skip with the reason."""
    src = os.environ.get("GNMX_GPGPUSIM_SRC")
    if not src:
        pytest.skip("no GPGPU-Sim source: set GNMX_GPGPUSIM_SRC to a tarball or clone of "
                    "accel-sim/gpgpu-sim_distribution (tests/gpu/README.md)")
    if not os.path.exists(src):
        pytest.skip(f"GNMX_GPGPUSIM_SRC={src} does not exist")
    return src


# gpgpusim.sh runs started and not yet checked: command -> (process, junit path, log path). The
# functional list's test starts the timing list beside it (both are one single-threaded simulator
# process each: on 2 cores the two lists take the time of the longer one, not of their sum).
_RUNS = {}


def start_list(command, folder):
    """Starts gpgpusim.sh `command` (a list of tests in one pytest process) in the background,
    once per session; its output goes to files in `folder`."""
    sim_source()
    if command not in _RUNS:
        os.makedirs(folder, exist_ok=True)
        junit, out = os.path.join(folder, "sim.xml"), os.path.join(folder, "sim.log")
        env = dict(os.environ, PYTHON=sys.executable)
        # -s: the simulator's own lines (one "executing kernel ..." per launch) reach the log
        with open(out, "w") as f:
            p = subprocess.Popen(["bash", SCRIPT, command, "-q", "-s", "-rs", f"--junitxml={junit}"],
                                 env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        _RUNS[command] = (p, junit, out)
    return _RUNS[command]


def finish_list(command, folder):
    """Waits for gpgpusim.sh `command` (started here if it was not); returns the log text and the
    junit counts, after asserting that it ran, passed and skipped nothing."""
    p, junit, out = start_list(command, folder)
    try:
        p.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    with open(out, errors="replace") as f:
        text = f.read()
    ours = [ln for ln in text.splitlines() if "GPGPU-Sim" not in ln and not ln.startswith(
        ("Max CTA", "kernel_", "gpu_", "Kernel ", "Destroy", "event update"))]
    tail = "\n".join(ours[-60:])
    assert p.returncode == 0, tail
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, (counts, tail)
    assert counts["skipped"] == 0, ("a test of the simulator list skipped", tail)
    counts["time"] = float(suite.get("time", 0))
    return text, counts


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpgpusim")


def test_ci_list_on_gpgpusim(sim_dir, request):
    if any(i.name == "test_timing_list_on_gpgpusim" for i in request.session.items):
        start_list("timing", str(sim_dir / "timing"))  # beside this one, when it will be checked
    text, counts = finish_list("ci", str(sim_dir / "ci"))
    # Every kernel ran on the simulator, but those listed with their reason.
    kernels = cuda_kernels()
    ran = launched(text, kernels)
    assert not ran & set(NOT_ON_SIM), ("listed as not on the simulator, but ran",
                                       sorted(ran & set(NOT_ON_SIM)))
    assert ran | set(NOT_ON_SIM) == kernels, ("kernels the simulator list never launched",
                                              sorted(kernels - ran - set(NOT_ON_SIM)))
    print(f"GPGPU-Sim: {counts['tests']} passed in {counts['time']:.0f} s, "
          f"{len(ran)} of {len(kernels)} kernels launched;",
          " ".join(re.findall(r"\[gpgpusim\] [^\n]* built in \d+ s", text)))


def test_timing_list_on_gpgpusim(sim_dir):
    """tests/gpu/sim/timing_tests.txt on the timing model: fix 10's check (bar.red state between
    launches) and the copy-ratio floors of tests/gpu/test_gpu_sim_speed.py."""
    text, counts = finish_list("timing", str(sim_dir / "timing"))
    print(f"GPGPU-Sim timing model: {counts['tests']} passed in {counts['time']:.0f} s;",
          " ".join(re.findall(r"\[gpusim\] [^\n]*", text)))
