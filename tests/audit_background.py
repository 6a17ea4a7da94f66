"""The full per-architecture resource audit of the CUDA 11.8 build (tests/cuda_resource_audit.py),
started in the background as soon as pytest has collected its test, so that its compiles (~15 min
of CPU: cicc + ptxas for 8 sources x 9 architectures) use the core the mostly single-threaded
suite leaves idle; tests/conftest.py moves the test that checks its result to the end of the run.

Runs when GNMX_AUDIT=1 (.ci/run sets it); GNMX_AUDIT=0 or unset: the test skips and says how to
run it. The CUDA 11.8 toolkit is fetched first when missing (tools/cuda11_toolchain.sh, ~1 min,
Debian packages).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEST_NAME = "test_audit_cuda_11_8_default_architectures"
_state = {}


def wanted():
    return os.environ.get("GNMX_AUDIT") == "1"


def _fetch_toolkit():
    """nvcc of the CUDA 11.8 toolkit, fetched when missing; None (with the reason) if it cannot be."""
    tool = os.path.join(ROOT, "tools", "cuda11_toolchain.sh")
    if subprocess.run(["bash", tool, "--check"], capture_output=True).returncode != 0:
        if not (shutil.which("apt-get") and shutil.which("dpkg")):
            return None, "the CUDA 11.8 toolkit is fetched from Debian packages: needs apt-get/dpkg"
    r = subprocess.run(["bash", tool], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError("tools/cuda11_toolchain.sh failed:\n" + r.stderr[-4000:])
    return os.path.join(r.stdout.strip().splitlines()[-1], "bin", "nvcc"), None


def _run():
    st = _state
    t0 = time.monotonic()
    try:
        nvcc, why = _fetch_toolkit()
        if nvcc is None:
            st["skip"] = why
            return
        out = os.path.join(st["dir"], "audit.json")
        cmd = [sys.executable, os.path.join(HERE, "cuda_resource_audit.py"), "--nvcc", nvcc,
               "--ccbin", "g++-11", "--json", out, "--jobs", os.environ.get("GNMX_JOBS", "2")]
        # niceness 10: the tests keep the CPU they need, the audit takes what they leave
        st["proc"] = subprocess.run(["nice", "-n", "10"] + cmd, capture_output=True, text=True,
                                    timeout=3600)
        st["data"] = json.load(open(out)) if os.path.exists(out) else None
    except Exception as e:  # reported by the test, not lost in the thread
        st["error"] = e
    finally:
        st["seconds"] = time.monotonic() - t0


def start():
    """Start the audit once per session (no-op unless wanted())."""
    if not wanted() or "thread" in _state:
        return
    _state["dir"] = tempfile.mkdtemp(prefix="gnmx-audit-")
    _state["thread"] = threading.Thread(target=_run, name="cuda-resource-audit", daemon=True)
    _state["thread"].start()


def schedule(items):
    """pytest_collection_modifyitems: the audit's test goes last, and the audit starts now."""
    audit = [it for it in items if it.name == TEST_NAME]
    if not audit:
        return
    items[:] = [it for it in items if it.name != TEST_NAME] + audit
    start()


def result(timeout=3600):
    """(completed process, the audit's JSON or None, wall seconds), waiting for it to finish; a
    skip reason string instead when the toolkit cannot be fetched here."""
    start()
    _state["thread"].join(timeout)
    if _state["thread"].is_alive():
        raise TimeoutError(f"the background resource audit did not finish in {timeout} s")
    if "error" in _state:
        raise _state["error"]
    if "skip" in _state:
        return _state["skip"]
    return _state["proc"], _state["data"], _state["seconds"]
