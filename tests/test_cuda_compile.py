"""CI: every CUDA source compiles (library with GNMX_CUDA=ON + GPU harness), without a GPU.

Runs tests/cuda_compile_check.sh (the library + the harness's nvcc-only fallback) and builds the
CMake target gn_harness the way the GPU machine does (tests/gpu/build.sh, GNMX_MXNET=OFF); skipped
when no nvcc (or cmake) is installed. Nothing is executed on a GPU: the GPU checks live in tests/gpu
(run by benchmarks/gpu/run_all.sh on a CUDA machine).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = os.environ.get("GNMX_CHECK_ARCH", "80")


def _nvcc():
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if not nvcc:
        pytest.skip("nvcc not found (set NVCC=/path/to/nvcc)")
    if subprocess.run(["cmake", "--version"], capture_output=True).returncode != 0:
        pytest.skip("cmake is not usable")
    return nvcc


def _no_mxnet_env(tmp_path, **kw):
    """PYTHONPATH with an `mxnet` that fails to import: the harness build must never need it."""
    fake = tmp_path / "no_mxnet" / "mxnet"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the GPU harness must not import mxnet')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "no_mxnet"), **kw)
    env.pop("GNMX_HARNESS_NVCC_ONLY", None)
    return env


def _harness_commands(build):
    """file -> nvcc/c++ command of the gn_harness target, from compile_commands.json."""
    with open(os.path.join(build, "compile_commands.json")) as f:
        return {os.path.realpath(e["file"]): e["command"] for e in json.load(f)
                if "gn_harness.dir" in e["command"]}


def _listed_sources():
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    with open(os.path.join(kdir, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    return {os.path.realpath(os.path.join(kdir, n)) for n in names if n}


def test_cuda_sources_compile():
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "cuda_compile_check.sh")],
                       capture_output=True, text=True, env=env, timeout=1500)
    out = r.stdout + r.stderr
    if r.returncode == 0 and "SKIPPED:" in r.stdout:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, out[-6000:]
    assert "cuda_compile_check: OK" in r.stdout
    # cuSOLVER (the DBN eigensolver for large groups) is dlopen'ed on first use, never linked.
    needed = subprocess.run(["readelf", "-d", os.path.join(ROOT, "build", "cuda-check", "lib",
                                                           "libgn_mx.so")],
                            capture_output=True, text=True).stdout
    assert "NEEDED" in needed and "cusolver" not in needed, needed
    # A toolkit newer than the CUDA of MXNet's wheels (11.2) is pointed out at configure time.
    m = re.search(r"release (\d+)\.(\d+)", subprocess.run([_nvcc(), "--version"], capture_output=True,
                                                          text=True).stdout)
    log = open(os.path.join(ROOT, "build", "cuda-check.cmake.log")).read()
    newer = m and int(m.group(1)) > 11
    assert ("is newer than the CUDA 11.2" in log) == bool(newer), log[-3000:]
    if newer and int(m.group(1)) >= 13:
        assert "r580" in log and "sm_50..sm_72" in log, log[-3000:]


def _cuda118():
    """CMake arguments for the CUDA 11.8 toolkit of tools/cuda11_toolchain.sh, or skip."""
    tool = os.path.join(ROOT, "tools", "cuda11_toolchain.sh")
    r = subprocess.run(["bash", tool, "--cmake-args"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("the CUDA 11.8 toolkit is not fetched (bash tools/cuda11_toolchain.sh)")
    return r.stdout.split()


def test_cuda_sources_compile_with_cuda_11_8():
    """The CUDA the wheel is built with (mxnet-cu112 users' drivers): default architectures cover
    every GPU mxnet-cu112 supports, and the library builds for sm_60, which CUDA 13 cannot target."""
    args = _cuda118()
    if subprocess.run(["cmake", "--version"], capture_output=True).returncode != 0:
        pytest.skip("cmake is not usable")
    import mxnet
    build = os.path.join(ROOT, "build", "cuda-check-11.8")
    base = ["cmake", "-S", ROOT, "-B", build, "-DMXNET_ROOT=" + os.path.dirname(mxnet.__file__),
            "-DGNMX_CUDA=ON"] + args
    r = subprocess.run(base + ["-UCMAKE_CUDA_ARCHITECTURES"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert ("CUDA kernels ON (nvcc 11.8.89, architectures 50-real;60-real;61-real;70-real;"
            "75-real;80-real;86-real;89-real;90)") in r.stdout, r.stdout[-3000:]
    assert "is newer than the CUDA" not in r.stdout + r.stderr
    r = subprocess.run(base + ["-DCMAKE_CUDA_ARCHITECTURES=60"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    r = subprocess.run(["cmake", "--build", build, "--target", "gn_mx", "-j",
                        os.environ.get("GNMX_JOBS", "2")], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    lib = os.path.join(build, "libgn_mx.so")
    nm = subprocess.run(["nm", "-C", lib], capture_output=True, text=True).stdout
    assert "gn_mx::group_norm_fwd_cuda" in nm
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
    assert "libcudart" not in needed and "libmxnet" not in needed, needed


def test_gpu_harness_cmake_target_without_mxnet(tmp_path):
    # What benchmarks/gpu/run_all.sh does on the GPU machine (nvcc + cmake + torch, no MXNet).
    nvcc = _nvcc()
    out = tmp_path / "harness"
    env = _no_mxnet_env(tmp_path, NVCC=nvcc, GNMX_CUDA_ARCH=ARCH, GNMX_HARNESS_OUT=str(out),
                        GNMX_JOBS="2")
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "build.sh")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "cmake target gn_harness" in r.stderr, r.stderr[-3000:]
    log = (out / "cmake" / "configure.log").read_text()
    assert "gn_mx: MXNet OFF" in log and "CUDA build:" not in log, log[-3000:]
    so = out / "libgn_harness.so"
    assert so.is_file()

    # Exactly harness.cc's GNH_API functions are exported (hidden visibility for everything else).
    with open(os.path.join(ROOT, "tests", "gpu", "harness.cc")) as f:
        api = set(re.findall(r"^GNH_API [^(]*?\b(gnh_\w+)\(", f.read(), re.M))
    assert len(api) >= 10, api
    if shutil.which("nm") is not None:
        nm = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True,
                            text=True, check=True).stdout
        exported = {line.split()[-1] for line in nm.splitlines() if line.strip()}
        assert exported == api, exported ^ api

    # The one source list + harness.cc, each compiled with SASS and PTX for the (only) arch.
    cmds = _harness_commands(str(out / "cmake"))
    harness = os.path.realpath(os.path.join(ROOT, "tests", "gpu", "harness.cc"))
    assert set(cmds) == _listed_sources() | {harness}, sorted(cmds)
    for f, cmd in cmds.items():
        assert "-O3" in cmd and "-fvisibility=hidden" in cmd and "-DGNMX_WITH_CUDA" in cmd, cmd
        if f.endswith(".cu"):
            assert f"code=[compute_{ARCH},sm_{ARCH}]" in cmd, cmd


def test_gpu_harness_sass_for_every_arch_ptx_for_the_highest(tmp_path):
    # Configure only: "75;90" -> sm_75 SASS, sm_90 SASS + compute_90 PTX (JIT on newer GPUs).
    nvcc = _nvcc()
    build = str(tmp_path / "build")
    r = subprocess.run(["cmake", "-S", ROOT, "-B", build, "-DGNMX_MXNET=OFF", "-DGNMX_CUDA=ON",
                        f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DCMAKE_CUDA_ARCHITECTURES=90;75",
                        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
                       capture_output=True, text=True, env=_no_mxnet_env(tmp_path), timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "gn_harness (architectures 75-real;90)" in r.stdout, r.stdout[-3000:]
    cu = {f: c for f, c in _harness_commands(build).items() if f.endswith(".cu")}
    assert set(cu) == _listed_sources()
    for cmd in cu.values():
        assert "arch=compute_75,code=[sm_75]" in cmd and "code=[compute_90,sm_90]" in cmd, cmd
        assert "code=[compute_75" not in cmd, cmd  # no PTX for the lower arch


# ------------------------------------------------------------------------------------------------
# "This build cannot run here": the first GPU call on a too-old driver or on a GPU without a kernel
# in the build explains what was found and what is needed (cuda_common.cuh cuda_error ->
# cuda_util.cu cuda_setup_error_message). Run without a GPU through the CPU emulator
# (tests/gpu/emu), which injects the CUDA error (GNMX_EMU_CUDA_ERROR) and reports a driver version
# (GNMX_EMU_DRIVER) and a compute capability (GNMX_EMU_CC).

SETUP_MAIN = r'''
#include <cstdio>
#include "cuda_util.h"
int main() {
  static unsigned char buf[64];
  const char* e = gn_mx::zero_cuda(buf, sizeof buf, nullptr);  // every CUDA error goes via cuda_error
  std::printf("%s\n", e ? e : "OK");
  return 0;
}
'''

ARCHS_118 = "50-real,60-real,61-real,70-real,75-real,80-real,86-real,89-real,90"


@pytest.fixture(scope="module")
def setup_error_exe(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu", "emu"))
    import build_emu
    out = tmp_path_factory.mktemp("setup_err")
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    src = out / "cuda_util_emu.cc"
    cu = os.path.join(kdir, "cuda_util.cu")
    src.write_text(f'#line 1 "{cu}"\n' + build_emu.rewrite(cu))
    (out / "main.cc").write_text(SETUP_MAIN)
    exe = str(out / "setup_err")
    r = subprocess.run(["g++", "-std=c++20", "-O0", "-mf16c", "-pthread", "-D__CUDACC__",
                        "-DGNMX_WITH_CUDA", "-DCUDART_VERSION=11080",
                        f'-DGNMX_CUDA_ARCHS="{ARCHS_118}"', "-include", "cuda_emu.h",
                        "-I", os.path.join(ROOT, "tests", "gpu", "emu", "include"), "-I", kdir,
                        "-I", os.path.join(ROOT, "src", "operator"), str(src), str(out / "main.cc"),
                        "-o", exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def _setup_error(exe, **env):
    r = subprocess.run([exe], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **{k: str(v) for k, v in env.items()}))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_cuda_setup_error_driver_too_old(setup_error_exe):
    # A CUDA 11.8 build on a driver of CUDA 11.0 (r450.51, below minor-version compatibility).
    msg = _setup_error(setup_error_exe, GNMX_EMU_CUDA_ERROR=35, GNMX_EMU_DRIVER=11000)
    assert "cudaErrorInsufficientDriver" in msg, msg
    assert "driver reports CUDA 11.0" in msg and "CUDA 11.8 runtime" in msg, msg
    assert "NVIDIA driver >= 450.80.02" in msg and "docs/install.md" in msg, msg
    # No driver at all (cudaDriverGetVersion reports 0).
    msg = _setup_error(setup_error_exe, GNMX_EMU_CUDA_ERROR=35, GNMX_EMU_DRIVER=0)
    assert "(no driver found)" in msg, msg


def test_cuda_setup_error_no_kernel_for_the_gpu(setup_error_exe):
    # A Kepler GPU (sm_37): below every SASS arch of the build, and the PTX is compute_90.
    msg = _setup_error(setup_error_exe, GNMX_EMU_CUDA_ERROR=209, GNMX_EMU_CC=37,
                       GNMX_EMU_DRIVER=11040)
    assert "cudaErrorNoKernelImageForDevice" in msg, msg
    assert "compute capability 3.7" in msg, msg
    assert "SASS for sm_50, sm_60, sm_61, sm_70, sm_75, sm_80, sm_86, sm_89, sm_90" in msg, msg
    assert "PTX for compute_90" in msg and "GNMX_CUDA_ARCH=37" in msg, msg
    assert "driver reports 11.4" in msg, msg


def test_cuda_errors_without_setup_problem_pass_through(setup_error_exe):
    assert _setup_error(setup_error_exe) == "OK"
    assert _setup_error(setup_error_exe, GNMX_EMU_CUDA_ERROR=2) == "cuda_emu error"


def test_every_cuda_error_goes_through_cuda_error():
    # One place decides how a CUDA error reads: no .cu file formats cudaError_t itself.
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    for name in os.listdir(kdir):
        if name.endswith((".cu", ".cuh")) and name not in ("cuda_common.cuh", "cuda_util.cu"):
            with open(os.path.join(kdir, name)) as f:
                text = re.sub(r"//.*|/\*.*?\*/", "", f.read(), flags=re.S)
            assert "cudaGetErrorString" not in text, name
