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


def test_selftest_gpus_on_a_cpu_only_mxnet_is_one_line_exit_2():
    """--gpus 0 where MXNet has no CUDA: one line with the reason, exit 2 (not a wall of FAILs)."""
    import mxnet as mx
    if mx.runtime.Features().is_enabled("CUDA"):
        import pytest
        pytest.skip("this MXNet has CUDA: the CPU-only message does not apply")
    r = _selftest("--gpus", "0")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip().splitlines() == [
        "gn_mx selftest could not start: MXNet 1.9.1 is built without CUDA (GPU support is "
        "disabled): install mxnet-cu112==1.9.1, or run with --cpu"], r.stdout
    r = _selftest("--gpus", "0,x")
    assert r.returncode == 2 and r.stdout.strip() == (
        "gn_mx selftest could not start: ValueError: --gpus wants comma-separated GPU ids such "
        "as 0,1; got '0,x'"), r.stdout


class _FakeMx:
    """The parts of mxnet that gpu_problem reads, for the cases this machine cannot produce."""

    def __init__(self, cuda, n_gpu):
        self.__version__ = "1.9.1"
        self.runtime = type("R", (), {"Features": lambda s=None: type(
            "F", (), {"is_enabled": lambda s, name: cuda})()})()
        self.context = type("C", (), {"num_gpus": staticmethod(lambda: n_gpu)})()


def test_gpu_problem_names_each_reason(monkeypatch):
    import gn_mx
    cuda_build = dict(gn_mx.build_info(), cuda={"runtime": "11.8"})
    monkeypatch.setattr(gn_mx, "build_info", lambda: cuda_build)
    assert selftest.gpu_problem(_FakeMx(True, 2), [0, 1]) is None
    assert selftest.gpu_problem(_FakeMx(False, 0), []) is None  # --cpu: nothing asked
    assert selftest.gpu_problem(_FakeMx(True, 2), [2]) == \
        "GPU id(s) [2] asked for, but MXNet sees 2 GPU(s), ids 0-1"
    assert "MXNet sees no GPU (no NVIDIA driver" in selftest.gpu_problem(_FakeMx(True, 0), [0])
    monkeypatch.setattr(gn_mx, "build_info", lambda: dict(cuda_build, cuda=None))
    assert "this gn_mx build has no CUDA kernels" in selftest.gpu_problem(_FakeMx(True, 1), [0])


def test_a_failing_check_shows_the_errors_meaningful_line():
    """An MXNetError's text starts with 'Traceback (most recent call last):' and frames; the
    report line is its message."""
    import mxnet as mx
    import gn_mx  # noqa: F401
    try:
        mx.nd.gn_group_norm(mx.nd.ones((2, 4, 3)), mx.nd.ones((4,), dtype="float64"),
                            mx.nd.ones((4,)), num_groups=2)[0].asnumpy()
    except mx.base.MXNetError as e:
        line = selftest._first_line(e)
    assert line.startswith("MXNetError: gn_group_norm: gamma dtype must equal the data dtype"), line


def test_new_checks_fail_on_a_wrong_reference(monkeypatch):
    """The WS, channels-last and double-backward checks compare with their references: each
    raises when its reference is made wrong (and passes as it is)."""
    import mxnet as mx
    import numpy as np
    checks = {n: f for n, f in selftest.op_checks()
              if n in ("weight_standardize float32 4x2x3x3", "group_norm axis=-1 float32 2x6x3x4",
                       "group_norm double backward float32 2x6x4")}
    assert len(checks) == 3
    for f in checks.values():
        assert f(mx.cpu()) <= 1
    ws_ref, bwd_ref, gn_ref = selftest._ws_ref, selftest.ref.group_norm_bwd_ref, \
        selftest.ref.group_norm_ref
    monkeypatch.setattr(selftest, "_ws_ref", lambda w, g, e: ws_ref(w, np.ones_like(g), e))
    monkeypatch.setattr(selftest.ref, "group_norm_ref",
                        lambda x, g, b, G, eps, act=None: gn_ref(x, g, b, max(1, G // 3), eps))
    monkeypatch.setattr(selftest.ref, "group_norm_bwd_ref",
                        lambda x, g, dy, G, eps, **k: bwd_ref(x, g, dy * 1.01, G, eps, **k))
    for name, f in checks.items():
        try:
            f(mx.cpu())
        except AssertionError:
            continue
        raise AssertionError(f"{name} passed with a wrong reference")


def test_every_op_of_the_library_is_checked():
    from gn_mx import _library
    names = [n for n, _ in selftest.op_checks()]
    for op in _library.OPS:
        prefix = selftest.CHECKED_OPS[op]  # a KeyError: a new op without a self-test check
        assert any(n.startswith(prefix + " ") for n in names), op


def test_sync_dbn_checks_pass_and_fail_on_a_wrong_reference(monkeypatch):
    """The gn_sync_sum / gn_dbn_whiten / gn_dbn_apply checks pass, and the whiten and apply checks
    raise when their float64 references are made wrong."""
    import mxnet as mx
    import numpy as np
    checks = {n: f for n, f in selftest.op_checks()
              if n.split()[0] in ("sync_sum", "dbn_whiten", "dbn_apply")}
    assert len(checks) == 6, sorted(checks)
    for f in checks.values():
        assert f(mx.cpu()) <= 1
    whiten_ref, apply_ref = selftest._whiten_ref, selftest._dbn_apply_ref
    monkeypatch.setattr(selftest, "_whiten_ref", lambda c, e, w, T: whiten_ref(c, 2 * e, w, T))
    monkeypatch.setattr(selftest, "_dbn_apply_ref",
                        lambda x, g, b, m, W: apply_ref(x, g, b, m, np.swapaxes(W, 1, 2)))
    for name, f in checks.items():
        if name.startswith("sync_sum"):
            continue
        try:
            f(mx.cpu())
        except AssertionError:
            continue
        raise AssertionError(f"{name} passed with a wrong reference")
