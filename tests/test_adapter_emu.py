"""The lib_api adapter's "gpu" path, run without a GPU.

No GPU is lent to most sessions and CI has none, so the adapter's gpu callbacks (device choice,
workspace sizes from the CUDA kernels, argument filling, aux-gradient zeroing, the CUDA group-size
limit) would otherwise only ever be compiled. Here the adapter, lib_api.cc, the CPU kernels and the
CUDA kernels built for the CPU emulator (tests/gpu/emu: device pointers are host pointers) are linked
into one program, tests/gpu/emu/adapter_driver.cc, which calls every op's registered cpu and gpu
forward/backward on the same inputs and compares them, and checks that the GroupNorm kernels' error
strings are one text per rule on both devices (see the driver's header).
"""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mxnet
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "tests", "gpu", "emu")
KERNELS = os.path.join(ROOT, "src", "operator", "kernels")
MX = os.path.dirname(mxnet.__file__)

sys.path.insert(0, EMU)
import build_emu  # noqa: E402  (the emulator's launch rewrite)


def _compile(args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(" ".join(args) + "\n" + r.stdout + r.stderr)
    return args[-1]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    out = tmp_path_factory.mktemp("adapter_emu")
    inc = ["-I", os.path.join(ROOT, "src", "operator"), "-I", os.path.join(MX, "include"),
           "-I", os.path.join(MX, "include", "mxnet")]
    # CUDA sources, rewritten for the emulator: build_emu.py's objects (cached by input hash and
    # shared with tests/gpu/harness_np.py's emulated harness).
    cuda_objs = build_emu.compile_objects(os.path.join(ROOT, "build", "gpu-emu"))
    jobs = []
    # Host code as CMake builds it for a CUDA build (lib_api.cc with the same renames).
    link = os.path.join(ROOT, "src", "link")  # the replaced lib_api entry points
    host = [os.path.join(MX, "src", "lib_api.cc"), os.path.join(EMU, "adapter_driver.cc")]
    host += [os.path.join(link, f) for f in sorted(os.listdir(link)) if f.endswith(".cc")]
    host += [os.path.join(ROOT, "src", "operator", "mx", f)
             for f in sorted(os.listdir(os.path.join(ROOT, "src", "operator", "mx"))) if f.endswith(".cc")]
    host += [os.path.join(KERNELS, f) for f in sorted(os.listdir(KERNELS)) if f.endswith(".cc")]
    for i, src in enumerate(host):
        defs = []
        if src.endswith("lib_api.cc"):
            defs = ["-D_opRegSize=gnmx_lib_api_opRegSize", "-D_msgSize=gnmx_lib_api_msgSize",
                    "-D_msgGet=gnmx_lib_api_msgGet"]
        jobs.append(["g++", "-std=c++17", "-O1", "-fPIC", "-fopenmp", "-pthread", "-DGNMX_WITH_CUDA"]
                    + defs + inc + ["-c", src, "-o", os.path.join(out, f"host{i}.o")])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        objs = cuda_objs + list(ex.map(_compile, jobs))
    exe = os.path.join(out, "adapter_driver")
    _compile(["g++", "-fopenmp", "-pthread"] + objs + ["-ldl", "-o", exe])
    return exe


def test_gpu_callbacks_match_cpu_callbacks(driver):
    r = subprocess.run([driver], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = r.stdout.splitlines()
    failed = [l for l in lines if l.startswith("FAIL")]
    assert r.returncode == 0 and not failed, "\n".join(failed) + r.stderr[-2000:]
    passed = [l for l in lines if l.startswith("PASS")]
    # Every op ran on both contexts, for every dtype, and the error checks ran.
    for op in ("gn_moments", "gn_group_norm", "gn_channel_affine", "gn_dbn", "gn_dbn_inference",
               "_backward_gn_group_norm", "_backward_gn_moments"):
        for dt in ("f32", "f16", "f64"):
            assert any(l.startswith(f"PASS {op} {dt}") and "gpu runs" in l for l in passed), (op, dt)
    for op in ("gn_dbn affine", "gn_dbn_inference affine", "gn_dbn iternorm"):  # newer paths
        for dt in ("f32", "f16", "f64"):
            assert any(l.startswith(f"PASS {op} {dt}") and "gpu runs" in l for l in passed), (op, dt)
    for label in ("gn_group_norm N=150", "gn_channel_affine N=300", "gn_channel_affine N=150 S=33",
                  "_backward_gn_group_norm N=150"):  # parameter gradients over chunks of N
        assert f"PASS {label} gpu runs" in passed, label
    assert any("exceeds the gpu limit 512" in l for l in passed)
    assert any("unsupported context 'opencl'" in l for l in passed)
    assert any("gpu grad2: all zeros" in l for l in passed)
    assert len(passed) > 150, len(passed)
    # The GroupNorm kernels' error strings: one text per rule on both devices, no prefix.
    msgs = [l for l in passed if l.startswith("PASS kernel message ")]
    assert len(msgs) == 10, "\n".join(msgs)
    for l in msgs:
        assert "CUDA backward" not in l and "'group_norm" not in l and "'moments" not in l, l
    assert any("no workspace: cpu 'backward needs a workspace' gpu 'backward needs a workspace'"
               in l for l in msgs)
    assert any("activation without beta: cpu 'backward with an activation needs beta' gpu "
               "'backward with an activation needs beta'" in l for l in msgs)
    assert any("param dtype (forward): cpu 'parameter dtype must equal" in l for l in msgs)


# ------------------------------------------------------------------------------------------------
# Robustness on hardware, through the emulator's injected errors (cuda_emu.h): the device check,
# errors left by earlier GPU work, one cuSOLVER handle per (device, stream), GNMX_CUDA_SYNC=1.


def test_gpu_robustness_device_earlier_errors_and_cusolver_handles(driver):
    fake = build_emu.build_fake_cusolver(os.path.join(ROOT, "build", "gpu-emu"))
    r = subprocess.run([driver, "robustness", fake], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = r.stdout.splitlines()
    failed = [l for l in lines if l.startswith("FAIL")]
    assert r.returncode == 0 and not failed, "\n".join(failed) + r.stderr[-2000:]
    passed = "\n".join(l for l in lines if l.startswith("PASS"))
    for what in ("device mismatch: gn_group_norm: the data is on gpu(0) but the current CUDA "
                 "device is 1",
                 "pending error from earlier work: gn_group_norm: CUDA reported "
                 "cudaErrorIllegalAddress",
                 "gpu op after the pending error was reported runs",
                 "sticky error from earlier work: gn_group_norm: CUDA reported",
                 "sticky error names the op that found it: gn_moments: CUDA reported",
                 "gn_dbn with cuSOLVER on two streams runs",
                 "cuSOLVER handles: 3 created, 0 re-bound, 0 bad calls"):
        assert what in passed, what
    assert passed.count("gn_dbn cusolver on stream: max diff") == 4


def _fault(driver, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("GNMX_CUDA_SYNC", "GNMX_EMU_KERNEL_FAULT")}
    e.update(OMP_NUM_THREADS="1", **env)
    r = subprocess.run([driver, "fault"], capture_output=True, text=True, timeout=120, env=e)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    return r.stdout.split("OUTCOME ", 1)[1].strip()


def test_gpu_sync_mode_names_the_op_and_the_kernel(driver):
    # A kernel fault is asynchronous: by default the op returns and a later CUDA call sees it.
    assert _fault(driver) == "OK"
    assert _fault(driver, GNMX_EMU_KERNEL_FAULT="700") == "OK"
    # GNMX_CUDA_SYNC=1: synchronized after the first kernel; the op and the launch line are named.
    msg = _fault(driver, GNMX_EMU_KERNEL_FAULT="700", GNMX_CUDA_SYNC="1")
    assert msg.startswith("gn_group_norm: the kernel launched at group_norm_cuda.cu:"), msg
    assert ("failed while running: cudaErrorIllegalAddress (an illegal memory access was "
            "encountered) (GNMX_CUDA_SYNC=1 synchronizes after every gn_mx kernel)") in msg, msg
    # Without a fault the synchronous mode changes nothing.
    assert _fault(driver, GNMX_CUDA_SYNC="1") == "OK"
