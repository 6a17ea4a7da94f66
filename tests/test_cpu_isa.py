"""The CPU ISA levels of cpu_isa.h (generic, avx2, avx512), each forced in a fresh process
(GNMX_CPU_ISA is read once per process): build_info() names it; the edge-case list and the op checks
of python -m gn_mx.selftest pass on it; GroupNorm on shapes long enough for every vector loop (full
vectors, masked or scalar tails, unaligned streaming heads, streamed outputs, channels-last rows)
agrees with the float64 reference within the one tolerance table (gn_mx/_tolerances.py), the same
for every level. The level the CPU has also runs the rest of the suite.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_isa_levels():
    """The levels of cpu_isa.h this CPU supports, lowest first (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(ln for ln in f if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return ["generic"]
    levels = ["generic"]
    if {"avx2", "fma", "f16c"} <= flags:
        levels.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            levels.append("avx512")
    return levels


LEVELS = cpu_isa_levels()


def _run(code, level, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("GNMX_CPU_ISA", None)
    if level is not None:
        env["GNMX_CPU_ISA"] = level
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)] + list(args),
                          capture_output=True, text=True, env=env, timeout=600)


INFO = """
    import json, gn_mx
    i = gn_mx.build_info()
    print("INFO " + json.dumps([i["cpu_isa"], i["cpu_isa_active"]]))
"""


def test_unknown_level_says_so_and_runs_the_cpus():
    r = _run(INFO, "avx3")
    assert r.returncode == 0, r.stderr[-3000:]
    compiled, active = json.loads(r.stdout.split("INFO ", 1)[1])
    assert compiled == ["generic", "avx2", "avx512"] and active == LEVELS[-1], (compiled, active)
    assert "GNMX_CPU_ISA=avx3 is not one of generic, avx2, avx512" in r.stderr, r.stderr[-3000:]


LONG_RUNS = """
    import sys
    import numpy as np, mxnet as mx, gn_mx
    from gn_mx import _reference as ref
    from gn_mx.selftest import MxRunner, _close, _data
    from gn_mx._tolerances import TOL, GRAD_TOL
    level, top = sys.argv[1], sys.argv[2]
    info = gn_mx.build_info()
    assert info["cpu_isa"] == ["generic", "avx2", "avx512"], info["cpu_isa"]
    assert info["cpu_isa_active"] == level, info["cpu_isa_active"]
    if level != top:  # the CPU's own level runs these in test_edge_cases.py / test_selftest.py
        from gn_mx.selftest import main
        assert main(["--cpu", "--no-timing"]) == 0, "selftest failed"
    run = MxRunner(mx.cpu())
    # (shape, G, axis, dtypes, acts): runs of 1073 / 1030 elements (tails, unaligned starts); 4.3 and
    # 8.5 MB fp32 (streamed dx, streamed y); channels-last rows of 24 / 40 channels.
    CASES = [((2, 6, 37, 29), 3, 1, (np.float16, np.float32, np.float64), (None, "relu", "silu")),
             ((1, 4, 1030), 2, 1, (np.float16, np.float32), (None, "silu")),
             ((1, 16, 256, 260), 4, 1, (np.float32,), (None,)),
             ((2, 16, 256, 260), 4, 1, (np.float16, np.float32,), ("relu",)),
             ((2, 37, 29, 24), 6, -1, (np.float16, np.float32, np.float64), (None, "silu")),
             ((1, 19, 21, 40), 4, -1, (np.float32,), ("relu",))]
    for shape, G, axis, dtypes, acts in CASES:
        for dtype in dtypes:
            for act in acts:
                x, dy = _data(shape, dtype, 1, 0.5), _data(shape, dtype, 2)
                C = shape[axis]
                g, b = _data((C,), dtype, 3), _data((C,), dtype, 4)
                r = run.group_norm(x, g, b, G, 1e-5, act=act, dy=dy, axis=axis)
                xf, dyf = np.moveaxis(x, axis, 1), np.moveaxis(dy, axis, 1)
                y, mean, rstd = ref.group_norm_ref(xf, g, b, G, 1e-5, act=act)
                dx, dg, db = ref.group_norm_bwd_ref(xf, g, dyf, G, 1e-5, act=act, beta=b)
                for k, got, want, t in (("y", np.moveaxis(r["y"], axis, 1), y, TOL),
                                        ("mean", r["mean"], mean, TOL), ("rstd", r["rstd"], rstd, TOL),
                                        ("dx", np.moveaxis(r["dx"], axis, 1), dx, GRAD_TOL),
                                        ("dgamma", r["dgamma"], dg, GRAD_TOL),
                                        ("dbeta", r["dbeta"], db, GRAD_TOL)):
                    _close(f"{shape} {np.dtype(dtype).name} {act} {k}", got, want, dtype, t)
    print("LONG_OK", level)
"""


@pytest.mark.parametrize("level", LEVELS)
def test_each_level(level):
    """build_info() names the forced level; below the CPU's own level the selftest's edge cases and
    op checks (every op, dtype, 0-3 spatial dims) pass; on every level the long-run cases."""
    r = _run(LONG_RUNS, level, level, LEVELS[-1])
    assert r.returncode == 0 and f"LONG_OK {level}" in r.stdout, r.stdout[-4000:] + r.stderr[-3000:]


@pytest.mark.parametrize("fp16_avx512", ["0", "1"])
def test_avx512_level_both_fp16_tables(fp16_avx512):
    """The avx512 level's fp16 primitives: the AVX2/F16C table (other vendors) and the 512-bit one
    (Intel), each forced with GNMX_CPU_FP16_AVX512 so that both run on any AVX-512 CPU: the
    long-run cases (the selftest's checks too) within the same tolerances."""
    if "avx512" not in LEVELS:
        pytest.skip("this CPU has no avx512 level")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "GNMX_CPU_ISA": "avx512",
           "GNMX_CPU_FP16_AVX512": fp16_avx512}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(LONG_RUNS), "avx512", "none"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "LONG_OK avx512" in r.stdout, r.stdout[-4000:] + r.stderr[-3000:]


DBN_BITS = """
    import hashlib, numpy as np, mxnet as mx, gn_mx
    out = []
    # D = 136: 16-double / 32-float strips, then an 8-wide avx2 strip or the generic columns;
    # D = 100: dmm_nn's 16-column strips and 4 columns left; G = 2 groups
    for D, wh in ((136, "iternorm"), (100, "zca"), (136, "zca")):
        for dt in ("float32", "float64"):
            rng = np.random.RandomState(D)
            x = mx.nd.array(rng.randn(48, 2 * D, 2, 2), dtype=dt)
            x.attach_grad()
            blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, in_channels=2 * D, whitening=wh,
                                              epsilon=1e-3)
            blk.initialize()
            blk.cast(dt)
            with mx.autograd.record():
                y = blk(x)
            y.backward(mx.nd.array(rng.randn(*x.shape), dtype=dt))
            b = y.asnumpy().tobytes() + x.grad.asnumpy().tobytes() + blk.gamma.grad().asnumpy().tobytes()
            out.append(hashlib.md5(b).hexdigest())
    print("BITS " + " ".join(out))
"""


def test_dbn_products_same_bits_on_avx2_and_avx512():
    """DBN's D x D products (ZCA's dmm_nn, IterNorm's blocked chains) run 512-bit tiles on the
    avx512 level; each entry is the same FMA chain as the avx2 tile's, so outputs and gradients of
    ZCA and IterNorm (fp32 and fp64) are bit for bit the avx2 level's, strips, leftover avx2 strips
    and generic columns included."""
    if "avx512" not in LEVELS:
        pytest.skip("this CPU has no avx512 level")
    got = {}
    for level in ("avx2", "avx512"):
        r = _run(DBN_BITS, level)
        assert r.returncode == 0, r.stderr[-3000:]
        got[level] = r.stdout.split("BITS ", 1)[1].split()
    assert got["avx2"] == got["avx512"], got


FP16_HASH = """
    import hashlib, numpy as np, mxnet as mx, gn_mx
    x = mx.nd.array(np.random.RandomState(0).randn(2, 64, 37, 29), dtype="float16")
    g, b = mx.nd.ones(64, dtype="float16"), mx.nd.zeros(64, dtype="float16")
    mean = mx.nd.gn_group_norm(x, g, b, num_groups=32)[1].asnumpy()
    print("HASH " + hashlib.md5(mean.tobytes()).hexdigest())
"""


def test_fp16_avx512_override_takes_effect():
    """GNMX_CPU_FP16_AVX512 switches the avx512 level's fp16 table: 16- and 8-lane sums round
    differently, so the float32 group means of the same fp16 data differ in their last bits."""
    if "avx512" not in LEVELS:
        pytest.skip("this CPU has no avx512 level")
    got = []
    for v in ("0", "1"):
        env = {**os.environ, "GNMX_CPU_ISA": "avx512", "GNMX_CPU_FP16_AVX512": v}
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(FP16_HASH)], capture_output=True,
                           text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        got.append(r.stdout.split("HASH ", 1)[1].strip())
    assert got[0] != got[1], got


# EVEX-only operands: zmm registers, mask registers k1-k7, xmm/ymm 16-31, embedded broadcasts.
EVEX = re.compile(r"%zmm|%k[1-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to")


def evex_functions(lib):
    """Names of the functions of `lib` whose code uses AVX-512 (EVEX-only) operands."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], capture_output=True,
                         text=True, check=True).stdout
    found, fn = set(), None
    for line in out.splitlines():
        if line.endswith(">:"):
            fn = line.split(" <", 1)[1][:-2]
        elif fn is not None and EVEX.search(line):
            found.add(fn)
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_avx512_code_only_in_the_avx512_level():
    """The library runs on CPUs without AVX-512 (the manylinux2014 wheel targets baseline x86-64):
    only the functions of the avx512 level (target attributes, named *avx512*) use its registers."""
    import gn_mx
    found = evex_functions(gn_mx.library_path())
    assert found and all("avx512" in f for f in found), sorted(f for f in found if "avx512" not in f)
