"""The DBN CUDA forward's eigensolver paths (dbn_cuda.cu's EigPath, chosen by GNMX_DBN_CUDA_EIG).

  shared:   block-parallel Jacobi with A and U^T in shared memory (auto while it fits)
  global:   the same Jacobi on matrices in the workspace (only when asked for)
  cusolver: cusolverDnDsyevd per group, loaded at run time (auto above the shared limit); under the
            emulator, tests/gpu/emu/fake_cusolver.cc stands in for the library
Each path against the float64 numpy reference (forward and backward, fp16/fp32/fp64, G > 1, D at
the shared-memory boundary, repeated and tiny eigenvalues, non-finite input), shared == global bit
for bit (same rotations in the same order), deterministic reruns, and the errors: cuSOLVER
missing, GNMX_DBN_CUDA_EIG invalid, "shared" for a D that does not fit. numpy-driven like
test_gpu_dbn.py (GPU, emulator or GPGPU-Sim; the simulator has no cuSOLVER: those cases skip there).
"""
import os
import sys

import numpy as np
import pytest

from gpu_common import ACC, DTYPES, EMU, SIM, hnp, ids, rel_err, rng  # skips without g++ (emulator)
from reference import dbn_bwd_ref
from test_gpu_dbn import TOL, make, ref_dbn, whitening  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "emu"))
import build_emu  # noqa: E402

PATHS = ["shared", "global", "cusolver"]
MISSING = "cuSOLVER (libcusolver.so.11 or .so.12) could not be loaded"


@pytest.fixture
def eig_path(monkeypatch):
    """set(path): run the next forwards on that eigensolver path. cuSOLVER: the emulator's fake
    library, or on a GPU the real one (skip when it cannot be loaded; always on GPGPU-Sim, which
    simulates no cuSOLVER and whose device memory the emulator's host-memory fake cannot read)."""
    def set_path(path):
        monkeypatch.setenv("GNMX_DBN_CUDA_EIG", path)
        if EMU:
            monkeypatch.setenv("GNMX_CUSOLVER_LIBRARY", build_emu.build_fake_cusolver())
        elif path == "cusolver" and SIM:
            pytest.skip("not on GPGPU-Sim: no cuSOLVER there")
        elif path == "cusolver":
            try:
                hnp.dbn_fwd(make((8, 4), np.float64), 1)
            except RuntimeError as e:
                if MISSING in str(e):
                    pytest.skip("no cuSOLVER on this machine")
                raise
    return set_path


def check_forward(x, G, dtype, eps=1e-5, tol=None):
    C, D = x.shape[1], x.shape[1] // G
    acc = ACC(x.dtype)
    rm, rp = np.zeros(C, acc), np.zeros((G, D, D), acc)
    y, mean, U, lam = hnp.dbn_fwd(x, G, rm, rp, eps, 0.0)
    ry, rmu, rl, rW = ref_dbn(x, G, eps)
    tol = tol or TOL[dtype]
    assert rel_err(y, ry) < tol, rel_err(y, ry)
    assert (np.abs(lam - rl) / np.abs(rl)).max() < tol
    assert (lam[:, 1:] >= lam[:, :-1]).all(), "eigenvalues not ascending"
    Ud = U.astype(np.float64)
    assert rel_err(Ud.transpose(0, 2, 1) @ Ud, np.broadcast_to(np.eye(D), (G, D, D))) < tol
    W = whitening(U, lam)
    assert rel_err(W, rW) / np.abs(rW).max() < tol
    assert rel_err(rp, rW) / np.abs(rW).max() < tol  # running_proj = W with momentum 0
    return y, U, lam


# (shape, G): D = 1, 2, 3, 16 (G = 4), 33 (odd, above a 32-row tile), 40
CASES = [((16, 2, 3), 2), ((32, 6), 3), ((8, 9, 4), 3), ((8, 64, 3), 4), ((4, 33, 16), 1),
         ((64, 80), 2)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape,G,dtype", [c + (DTYPES[i % 3],) for i, c in enumerate(CASES)],
                         ids=ids)
def test_forward_each_path(eig_path, path, shape, G, dtype):
    # every path sees every dtype twice (the eigensolver is fp64 for all: dtype changes only Sigma)
    eig_path(path)
    check_forward(make(shape, dtype, seed=1), G, dtype)


@pytest.mark.parametrize("path,dtype", [("shared", np.float16), ("shared", np.float64),
                                        ("global", np.float32), ("cusolver", np.float16),
                                        ("cusolver", np.float64)], ids=ids)
def test_backward_after_each_path(eig_path, path, dtype):
    # the backward reads the forward's U, l: a wrong layout (U vs U^T) breaks dx, not only y
    eig_path(path)
    shape, G = (8, 24, 5), 2
    x = make(shape, dtype, seed=2)
    dy = rng(4).standard_normal(shape).astype(dtype)
    _, mean, U, lam = hnp.dbn_fwd(x, G)
    dx = hnp.dbn_bwd(dy, x, mean, U, lam, G)
    assert rel_err(dx, dbn_bwd_ref(x, dy, G, 1e-5)) < TOL[dtype] * (3 if dtype == np.float16 else 1)


def test_shared_and_global_agree_bit_for_bit_and_reruns_are_identical(eig_path):
    x = make((16, 48, 2), np.float64, seed=5)
    out = {}
    for path in ("shared", "global", "shared"):
        eig_path(path)
        y, mean, U, lam = hnp.dbn_fwd(x, 2)
        if path in out:
            assert out[path][0] == y.tobytes() and out[path][1] == U.tobytes()
        out[path] = (y.tobytes(), U.tobytes(), lam.tobytes())
    assert out["shared"] == out["global"]


def _degenerate(kind, N=64, D=24):
    r = rng(7)
    base = r.standard_normal((N, D // 3, 4))
    if kind == "repeated":  # rank D/3: eigenvalue eps repeated 2D/3 times (cond ~ 1e5)
        x = np.concatenate([base, base, base], 1)
    elif kind == "constant":  # every channel constant: Sigma = eps I, one eigenvalue D times
        x = np.ones((N, D, 4)) * np.arange(D, dtype=np.float64).reshape(1, D, 1)
    else:  # "graded": channel scales 1e-3 .. 1e3 (cond(Sigma) ~ 1e12 before eps)
        x = r.standard_normal((N, D, 4)) * np.logspace(-3, 3, D).reshape(1, D, 1)
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["repeated", "constant", "graded"])
def test_ill_conditioned_and_degenerate_covariance(eig_path, path, kind):
    eig_path(path)
    x = _degenerate(kind)
    # W = Sigma^{-1/2} is well defined for repeated eigenvalues (any basis of the eigenspace gives
    # the same W); its rounding error grows with cond(Sigma): ~1e5 (repeated), ~1e11 (graded: the
    # reference's own error is ~1e-6 there)
    y, U, lam = check_forward(x, 1, np.float64, tol=1e-4 if kind == "graded" else 1e-7)
    if kind == "constant":
        assert np.allclose(lam, 1e-5, rtol=1e-9)


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_group_gives_nan_only_there(eig_path, path):
    eig_path(path)
    x = make((8, 8, 4), np.float32)
    x[0, 0, 0] = np.nan
    y, mean, U, lam = hnp.dbn_fwd(x, 2)
    assert np.isnan(y[:, :4]).all() and np.isnan(lam[0]).all()
    assert np.isfinite(y[:, 4:]).all() and np.isfinite(lam[1]).all()


def test_cusolver_failure_info_gives_nan(eig_path, monkeypatch):
    if not EMU:
        pytest.skip("the fake library's failure injection (emulator only)")
    eig_path("cusolver")
    monkeypatch.setenv("GNMX_FAKE_CUSOLVER_INFO", "3")
    y, mean, U, lam = hnp.dbn_fwd(make((8, 6, 2), np.float64), 2)
    assert np.isnan(y).all() and np.isnan(lam).all()


def test_cusolver_missing_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("GNMX_DBN_CUDA_EIG", "cusolver")
    monkeypatch.setenv("GNMX_CUSOLVER_LIBRARY", "/nonexistent/libcusolver.so.11")
    with pytest.raises(RuntimeError) as e:
        hnp.dbn_fwd(make((8, 4), np.float32), 1)
    msg = str(e.value)
    assert MISSING in msg and "/nonexistent/libcusolver.so.11" in msg, msg
    assert "GNMX_DBN_CUDA_EIG=global" in msg and "LD_LIBRARY_PATH" in msg, msg


def test_invalid_path_is_an_error(monkeypatch):
    monkeypatch.setenv("GNMX_DBN_CUDA_EIG", "bogus")
    with pytest.raises(RuntimeError, match="GNMX_DBN_CUDA_EIG must be auto, shared, global or cusolver"):
        hnp.dbn_fwd(make((8, 4), np.float32), 1)


def _eig_smem(D, shared):
    """dbn_cuda.cu's eig_smem(D, shared).bytes (the layout rule this test pins)."""
    npairs, ld = (D + 1) // 2, (D + 1) | 1
    head = (2 * npairs * 8 + 2 * D * 8 + D * 4 + 2 * npairs * 4 + 15) // 16 * 16
    tiles = (64 * 17 + 16 * 64) * 8
    return head + max(2 * D * ld * 8 if shared else 0, tiles)


@pytest.mark.parametrize("optin", [49152, 232448])  # sm_50/60's 48 KB, sm_90's 227 KB
def test_auto_switches_to_cusolver_exactly_where_shared_memory_ends(monkeypatch, optin):
    if not EMU:
        pytest.skip("sets the emulator's shared-memory limit")
    static = 1024  # the emulator's static shared memory (GNMX_EMU_STATIC_SMEM default)
    monkeypatch.setenv("GNMX_EMU_SMEM_OPTIN", str(optin))
    dmax = max(D for D in range(1, 513) if _eig_smem(D, True) + static <= optin)
    assert dmax == {49152: 52, 232448: 118}[optin]
    monkeypatch.setenv("GNMX_CUSOLVER_LIBRARY", "/nonexistent/libcusolver.so.11")
    monkeypatch.delenv("GNMX_DBN_CUDA_EIG", raising=False)
    if optin == 49152:  # D = dmax runs in shared memory without cuSOLVER (fast enough here)
        check_forward(make((8, dmax, 2), np.float64, seed=3), 1, np.float64)
    for env in ("auto", None):
        if env:
            monkeypatch.setenv("GNMX_DBN_CUDA_EIG", env)
        with pytest.raises(RuntimeError, match="could not be loaded"):
            hnp.dbn_fwd(make((2, dmax + 1), np.float32), 1)
    monkeypatch.setenv("GNMX_DBN_CUDA_EIG", "shared")
    with pytest.raises(RuntimeError, match=f"group size {dmax + 1} needs .* bytes of shared memory"):
        hnp.dbn_fwd(make((2, dmax + 1), np.float32), 1)
    # above the limit, the fake cuSOLVER gives the reference result
    monkeypatch.setenv("GNMX_DBN_CUDA_EIG", "auto")
    monkeypatch.setenv("GNMX_CUSOLVER_LIBRARY", build_emu.build_fake_cusolver())
    if optin == 49152:
        check_forward(make((8, dmax + 1, 2), np.float64, seed=3), 1, np.float64)
