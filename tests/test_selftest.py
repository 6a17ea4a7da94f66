"""python -m gn_mx.selftest (shipped in the package, docs/selftest.md), run as a user runs it: in a
fresh interpreter, on the CPU here (CI has no GPU; on a GPU machine it also covers every GPU)."""
import os
import re
import subprocess
import sys

import edge_cases
from gn_mx import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _selftest(*args, pre=""):
    """Run the self-test in a fresh interpreter from a neutral folder; `pre`: code run before it."""
    code = pre + "\nimport sys\nfrom gn_mx import selftest\nsys.exit(selftest.main(sys.argv[1:]))\n"
    cmd = [sys.executable, "-m", "gn_mx.selftest"] if not pre else [sys.executable, "-c", code]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(ROOT), env=env)


def test_selftest_passes_on_the_cpu_with_a_readable_report():
    r = _selftest("--cpu")
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    import gn_mx
    assert gn_mx.build_info()["summary"] in out and gn_mx.library_path() in out
    assert re.search(r"^MXNet +1\.9\.\d .*numpy .*Python ", out, re.M), out[:2000]
    assert re.search(r"^CPU +\S", out, re.M) and "== CPU (cpu(0)) ==" in out
    # The one edge-case list, every case, every family passing.
    assert f"edge cases ({len(edge_cases.CASES)}," in out
    families = {c.id.split("[", 1)[0] for c in edge_cases.CASES}
    for fam in families:
        assert re.search(rf"\[PASS\] {fam} +(\d+)/\1$", out, re.M), fam
    # Every op, every dtype, forward + gradient vs float64.
    checks = selftest.op_checks()
    assert f"gradient checks vs float64 CPU references ({len(checks)}," in out
    for name, _ in checks:
        assert re.search(rf"\[PASS\] {re.escape(name)} +\d+\.\d\d of tolerance$", out, re.M), name
    for op in ("group_norm", "moments", "channel_affine", "dbn_inference", "dbn zca",
               "dbn iternorm"):
        for dt in ("float16", "float32", "float64"):
            assert any(n.startswith(f"{op} {dt}") for n, _ in checks), (op, dt)
    for act in ("none", "relu", "silu"):
        assert any(n.endswith(f"act={act}") for n, _ in checks), act
    # The timing table next to MXNet's own GroupNorm and BatchNorm.
    assert re.search(r"^  CPU +8x64x28x28 G=32 float32 +\d+\.\d+ +\d+\.\d+ +\d+\.\d+$", out, re.M), \
        out[-1500:]
    assert "FAIL" not in out
    assert re.search(r"^gn_mx selftest: PASSED in [\d.]+ s on 1 device\(s\)$", out, re.M)


PLANT = """
import mxnet as mx
import gn_mx  # registers the ops
_gn = mx.nd.gn_group_norm
def planted(*a, **k):  # y off by 1e-3 relative: every dtype's tolerance is tighter than that for y
    out = _gn(*a, **k)
    return [out[0] * (1 + 1e-3)] + list(out[1:])
mx.nd.gn_group_norm = planted
"""


def test_selftest_fails_on_a_planted_wrong_result():
    r = _selftest("--cpu", "--no-timing", pre=PLANT)
    out = r.stdout
    assert r.returncode == 1, out[-4000:] + r.stderr[-4000:]
    assert re.search(r"^gn_mx selftest: FAILED \(\d+ check\(s\)\)", out, re.M), out[-2000:]
    # The wrong op is named, the others still pass.
    assert re.search(r"\[FAIL\] group_norm float32 3x6x5 act=silu +AssertionError: y: off by", out)
    assert re.search(r"\[PASS\] moments float32 3x6x5 ", out)
    assert re.search(r"\[PASS\] dbn zca float64 ", out)
    assert re.search(r"FAIL single_element_groups\[", out)
    assert "timing" not in out


def test_selftest_usage_error_exits_2():
    r = _selftest("--no-such-flag")
    assert r.returncode == 2 and "usage: python -m gn_mx.selftest" in r.stderr
