"""Rewrite the CUDA sources for the CPU emulator (see include/cuda_emu.h) and build
libgn_harness_emu.so: python3 tests/gpu/emu/build_emu.py [out_dir]."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "gpu-emu")

LAUNCH = re.compile(r"(\b[A-Za-z_]\w*(?:<(?:[^<>;]|<(?:[^<>;]|<[^<>;]*>)*>)*>)?)<<<(.*?)>>>\(",
                    re.S)


def rewrite(src):
    s = open(src).read()
    s = LAUNCH.sub(lambda m: f"emu::launch({m.group(1)}, {m.group(2)})(", s)
    s = s.replace("extern __shared__ __align__(16) unsigned char smem[];",
                  "unsigned char* smem = emu::dyn_smem();")
    return s


def cuda_sources(kdir):
    """The CUDA sources, from the one list that CMake and tests/gpu/build.sh read too."""
    with open(os.path.join(kdir, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    return [os.path.join(kdir, n) for n in names if n]


def main():
    os.makedirs(OUT, exist_ok=True)
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    srcs = []
    for cu in cuda_sources(kdir):
        dst = os.path.join(OUT, os.path.basename(cu)[:-3] + "_emu.cc")
        with open(dst, "w") as f:
            f.write(f'#line 1 "{cu}"\n' + rewrite(cu))
        srcs.append(dst)
    srcs.append(os.path.join(ROOT, "tests", "gpu", "harness.cc"))
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-fPIC", "-shared", "-mf16c", "-pthread",
           "-U_FORTIFY_SOURCE", "-D__CUDACC__", "-DGNMX_WITH_CUDA", "-include", "cuda_emu.h",
           "-I", os.path.join(HERE, "include"), "-I", kdir, "-I", os.path.join(ROOT, "src", "operator"),
           "-o", os.path.join(OUT, "libgn_harness.so")] + srcs
    print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
