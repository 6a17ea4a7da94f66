"""Rewrite the CUDA sources for the CPU emulator (see include/cuda_emu.h) and build
libgn_harness.so from them and tests/gpu/harness.cc: python3 tests/gpu/emu/build_emu.py [out_dir].

The objects are compiled in parallel (GNMX_JOBS, default: all cores) and cached under
<out_dir>/obj-<hash>, the hash covering every source and header they read, this script and the
flags: tests/test_adapter_emu.py and tests/gpu/harness_np.py share them, and an unchanged tree
rebuilds nothing. The library is replaced atomically (a process that has the old one loaded keeps
it). GNMX_EMU_DEBUG=1 adds -g.
"""
import hashlib
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
KDIR = os.path.join(ROOT, "src", "operator", "kernels")
HARNESS = os.path.join(ROOT, "tests", "gpu", "harness.cc")
DEFAULT_OUT = os.path.join(ROOT, "build", "gpu-emu")

LAUNCH = re.compile(r"(\b[A-Za-z_]\w*(?:<(?:[^<>;]|<(?:[^<>;]|<[^<>;]*>)*>)*>)?)<<<(.*?)>>>\(",
                    re.S)


BOUNDS = re.compile(r"__launch_bounds__\(([^()]*)\)")


def fma():
    """GNMX_EMU_FMA=1: the build variant with FMA contraction (-ffp-contract=fast -mfma), as nvcc
    contracts a * b + c by default, so that tolerances are checked against GPU-like rounding."""
    return os.environ.get("GNMX_EMU_FMA") == "1"


def default_out():
    """build/gpu-emu, or build/gpu-emu-fma for the FMA variant (objects of both stay cached)."""
    return DEFAULT_OUT + ("-fma" if fma() else "")


def flags():
    """g++ flags of every emulated translation unit. -fno-omit-frame-pointer: the emulator tells
    shuffle call sites apart by their return-address chains (cuda_emu.h's call_site)."""
    f = ["-std=c++20", "-O1", "-fPIC", "-mf16c", "-pthread", "-U_FORTIFY_SOURCE", "-D__CUDACC__",
         "-fno-omit-frame-pointer", "-DGNMX_WITH_CUDA", "-include", "cuda_emu.h",
         "-I", os.path.join(HERE, "include"), "-I", KDIR, "-I", os.path.join(ROOT, "src", "operator")]
    f += ["-ffp-contract=fast", "-mfma"] if fma() else ["-ffp-contract=off"]
    return f + (["-g"] if os.environ.get("GNMX_EMU_DEBUG") == "1" else [])


def _launch(m, s, name):
    line = s.count("\n", 0, m.start()) + 1
    return f'emu::launch_named("{m.group(1)} ({name}:{line})", {m.group(1)}, {m.group(2)})('


def _bounds(s):
    """Each kernel declared with __launch_bounds__(n, ...) starts with emu::launch_bounds(n, ...)
    (the emulator checks the launch's block size against it)."""
    out, pos = [], 0
    for m in BOUNDS.finditer(s):
        body = s.index("{", m.end())
        out += [s[pos:body + 1], f" emu::launch_bounds({m.group(1)});"]
        pos = body + 1
    return "".join(out) + s[pos:]


def rewrite(src):
    s = open(src).read()
    name = os.path.basename(src)
    s = LAUNCH.sub(lambda m: _launch(m, s, name), s)
    s = _bounds(s)
    s = s.replace("extern __shared__ __align__(16) unsigned char smem[];",
                  "unsigned char* smem = emu::dyn_smem();")
    return s


def rewrite_headers(dst, kdir=KDIR):
    """The kernel folder's .cuh headers, rewritten like the sources (their kernels and launches,
    e.g. dbn_cuda.cu's dbn_*_cuda.cuh), into `dst`: a rewritten source written to `dst` finds them
    there first through its quoted #include; their own includes of ../common/ fall back to -I."""
    for name in sorted(os.listdir(kdir)):
        if not name.endswith(".cuh"):
            continue
        src = os.path.join(kdir, name)
        text = f'#line 1 "{src}"\n' + rewrite(src)
        path = os.path.join(dst, name)
        if os.path.exists(path) and open(path).read() == text:
            continue
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def cuda_sources(kdir=KDIR):
    """The CUDA sources, from the one list that CMake and tests/gpu/build.sh read too."""
    with open(os.path.join(kdir, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    return [os.path.join(kdir, n) for n in names if n]


def _inputs_hash(extra=()):
    h = hashlib.sha256(" ".join(flags()).encode())
    files = [os.path.abspath(__file__)] + list(extra)
    for d in (os.path.join(ROOT, "src", "operator"), os.path.join(HERE, "include")):
        for base, _, names in os.walk(d):
            files += [os.path.join(base, n) for n in names
                      if n.endswith((".h", ".cuh", ".cu", ".cc", ".txt"))]
    for p in sorted(files):
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + r.stdout + r.stderr)


def _jobs():
    return int(os.environ.get("GNMX_JOBS") or os.cpu_count() or 2)


def compile_objects(out=None, extra_sources=()):
    """Object files of the listed CUDA sources (rewritten) and of `extra_sources` (plain C++ seen
    through the emulator, e.g. harness.cc), compiled once per input hash."""
    out = out or default_out()
    cache = os.path.join(out, "obj-" + _inputs_hash(extra_sources))
    os.makedirs(cache, exist_ok=True)
    rewrite_headers(cache)
    jobs, objs = [], []
    for src in cuda_sources() + list(extra_sources):
        stem = os.path.basename(src).rsplit(".", 1)[0]
        obj = os.path.join(cache, stem + "_emu.o")
        objs.append(obj)
        if os.path.exists(obj):
            continue
        if src.endswith(".cu"):
            cc = os.path.join(cache, stem + "_emu.cc")
            with open(cc, "w") as f:
                f.write(f'#line 1 "{src}"\n' + rewrite(src))
        else:
            cc = src
        tmp = obj + f".{os.getpid()}.tmp"
        jobs.append((["g++"] + flags() + ["-c", cc, "-o", tmp], tmp, obj))

    def one(job):
        cmd, tmp, obj = job
        _run(cmd)
        os.replace(tmp, obj)

    if jobs:
        with ThreadPoolExecutor(max_workers=_jobs()) as ex:
            list(ex.map(one, jobs))
    return objs


def build_harness(out=None):
    """libgn_harness.so of the emulated kernels + harness.cc in `out` (default_out()); returns its
    path."""
    out = out or default_out()
    objs = compile_objects(out, [HARNESS])
    lib = os.path.join(out, "libgn_harness.so")
    stamp = lib + ".inputs"
    key = os.path.basename(os.path.dirname(objs[0]))
    if os.path.exists(lib) and os.path.exists(stamp) and open(stamp).read() == key:
        return lib
    tmp = lib + f".{os.getpid()}.tmp"
    _run(["g++", "-shared", "-pthread", "-o", tmp] + objs)
    os.replace(tmp, lib)
    with open(stamp, "w") as f:
        f.write(key)
    return lib


PROBE = os.path.join(HERE, "rules_probe.cu")


def build_probe(out=None):
    """librules_probe.so (rules_probe.cu: kernels that keep or break one hardware rule each, for
    tests/gpu/test_gpu_emu_rules.py) in `out` (default_out()); returns its path."""
    out = out or default_out()
    os.makedirs(out, exist_ok=True)
    lib = os.path.join(out, "librules_probe.so")
    key = _inputs_hash([PROBE])
    stamp = lib + ".inputs"
    if os.path.exists(lib) and os.path.exists(stamp) and open(stamp).read() == key:
        return lib
    cc = os.path.join(out, f"rules_probe_emu.{os.getpid()}.cc")
    with open(cc, "w") as f:
        f.write(f'#line 1 "{PROBE}"\n' + rewrite(PROBE))
    tmp = lib + f".{os.getpid()}.tmp"
    try:
        _run(["g++"] + flags() + ["-shared", "-o", tmp, cc])
    finally:
        os.remove(cc)
    os.replace(tmp, lib)
    with open(stamp, "w") as f:
        f.write(key)
    return lib


FAKE_CUSOLVER = os.path.join(HERE, "fake_cusolver.cc")


def build_fake_cusolver(out=DEFAULT_OUT):
    """libfake_cusolver.so (fake_cusolver.cc: cusolverDnDsyevd on host memory) in `out`, for
    GNMX_CUSOLVER_LIBRARY under the emulator; returns its path."""
    lib = os.path.join(out, "libfake_cusolver.so")
    key = _inputs_hash([FAKE_CUSOLVER])
    stamp = lib + ".inputs"
    if os.path.exists(lib) and os.path.exists(stamp) and open(stamp).read() == key:
        return lib
    os.makedirs(out, exist_ok=True)
    tmp = lib + f".{os.getpid()}.tmp"
    _run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-I", os.path.join(ROOT, "src", "operator"),
          "-o", tmp, FAKE_CUSOLVER])
    os.replace(tmp, lib)
    with open(stamp, "w") as f:
        f.write(key)
    return lib


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else default_out()
    print(build_harness(out), file=sys.stderr)


if __name__ == "__main__":
    main()
