"""The CPU emulator fails where a GPU would: every hardware rule of tests/gpu/emu/include/cuda_emu.h,
kept and broken, on the small kernels of tests/gpu/emu/rules_probe.cu.

Each rule is checked both ways (the kept form runs and gives the right result; the broken form
fails with a message naming the rule), so a rule the emulator stopped enforcing fails here.
Emulator only (numpy + ctypes + g++); skipped on a GPU machine, where the hardware itself decides.
"""
import ctypes
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness_np  # noqa: E402

if not harness_np.emulated():
    pytest.skip("emulator rules: this machine runs the kernels on a GPU", allow_module_level=True)
if shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)

from harness_np import build_emu  # noqa: E402

c_vp, c_int, c_uint, c_str = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
SIGS = {
    "probe_grid": [c_vp, c_uint, c_uint, c_uint, c_uint],
    "probe_bounded": [c_vp, c_uint],
    "probe_dyn": [c_vp, c_int, c_int],
    "probe_uninit": [c_vp, c_uint],
    "probe_shuffle": [c_vp, c_int],
    "probe_sync": [c_vp, c_int],
    "probe_uniform": [c_vp, c_int],
    "probe_race": [c_vp, c_uint],
    "probe_welford": [c_vp, c_int, c_vp, c_int],
}


@pytest.fixture(scope="module")
def lib():
    harness_np.load()  # the harness library loaded too: block starts must poison both's statics
    # its own out folder: the probe's objects never mix with the harness's
    path = build_emu.build_probe(os.path.join(build_emu.default_out(), "probe"))
    lib = ctypes.CDLL(path)
    for name, args in SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = c_str, args
    return lib


def call(fn, *args):
    """None or the launch's error string."""
    r = fn(*args)
    return None if r is None else r.decode()


def ptr(a):
    return a.ctypes.data


def test_launch_configuration(lib):
    out = np.full(2 * 3 * 4 * 32, -1, np.int32)
    assert call(lib.probe_grid, ptr(out), 2, 3, 4, 32) is None
    # blockIdx.z is iterated: every block of the 3-D grid ran once, with its own index
    assert (out.reshape(24, 32) == np.arange(24)[:, None]).all()
    for grid, threads, words in [((1, 1, 1), 1025, "1024 threads"), ((1, 1, 1), 0, "zero"),
                                 ((0, 1, 1), 32, "zero"), ((1, 65536, 1), 32, "65535"),
                                 ((1, 1, 65536), 32, "65535"), ((2 ** 31, 1, 1), 32, "2^31")]:
        err = call(lib.probe_grid, ptr(out), *grid, threads)
        assert err is not None and words in err, (grid, threads, err)
    # the error is reported once: the next launch succeeds
    assert call(lib.probe_grid, ptr(out), 1, 1, 1, 32) is None


def test_launch_bounds(lib):
    out = np.zeros(256, np.int32)
    assert call(lib.probe_bounded, ptr(out), 128) is None
    assert (out[:128] == 1).all()
    err = call(lib.probe_bounded, ptr(out), 256)
    assert err is not None and "__launch_bounds__(128)" in err and "256 threads" in err, err


@pytest.mark.parametrize("arch,optin", [("sm_90", 232448), ("sm_75", 65536), ("sm_61", 49152)])
def test_dynamic_shared_memory(lib, monkeypatch, arch, optin):
    monkeypatch.setenv("GNMX_EMU_ARCH", arch)
    out = np.zeros(2, np.float32)
    assert call(lib.probe_dyn, ptr(out), 40 * 1024, -1) is None  # <= 48 KB: no opt-in needed
    assert (out == 10 * 1024).all()
    big = 60 * 1024
    err = call(lib.probe_dyn, ptr(out), big, -1)
    assert err is not None and "cudaFuncSetAttribute" in err, err
    # static (GNMX_EMU_STATIC_SMEM, default 1024) + dynamic must stay within the opt-in limit
    limit = optin - 1024
    if big <= limit:
        assert call(lib.probe_dyn, ptr(out), big, limit) is None
        assert (out == big // 4).all()
        err = call(lib.probe_dyn, ptr(out), limit + 16, limit)
        assert err is not None and "cudaFuncSetAttribute" in err, err
    else:  # the attribute itself is refused above the architecture's limit
        err = call(lib.probe_dyn, ptr(out), big, big)
        assert err is not None, err
    # the recorded attribute is reset for the next test's architecture
    assert call(lib.probe_dyn, ptr(out), 1024, 0) is None


def test_static_plus_dynamic_over_optin(lib, monkeypatch):
    monkeypatch.setenv("GNMX_EMU_ARCH", "sm_75")
    out = np.zeros(2, np.float32)
    monkeypatch.setenv("GNMX_EMU_STATIC_SMEM", "0")
    assert call(lib.probe_dyn, ptr(out), 64 * 1024, 64 * 1024) is None
    monkeypatch.setenv("GNMX_EMU_STATIC_SMEM", "4096")  # the same launch, now too large
    err = call(lib.probe_dyn, ptr(out), 64 * 1024, -1)
    assert err is not None and "65536 bytes per block" in err, err
    monkeypatch.setenv("GNMX_EMU_STATIC_SMEM", "1024")
    assert call(lib.probe_dyn, ptr(out), 1024, 0) is None


def test_shared_memory_poisoned_at_block_start(lib, monkeypatch):
    out = np.zeros(6, np.float32)
    assert call(lib.probe_uninit, ptr(out), 3) is None
    assert np.isnan(out).all(), out  # neither the previous block's 7.0 nor zeros
    monkeypatch.setenv("GNMX_EMU_POISON", "0")  # what the emulator did before: stale values
    assert call(lib.probe_uninit, ptr(out), 3) is None
    assert (out[2:] == 7.0).all(), out


def test_shuffles(lib):
    out = np.zeros(64, np.float32)
    assert call(lib.probe_shuffle, ptr(out), 0) is None
    assert (out == (np.arange(64) % 32) ^ 1).all()
    err = call(lib.probe_shuffle, ptr(out), 1)
    assert err is not None and "divergent shuffle" in err and "another call site" in err, err
    err = call(lib.probe_shuffle, ptr(out), 2)
    assert err is not None and "deadlock" in err and "lanes 0x0000ffff" in err, err
    assert call(lib.probe_shuffle, ptr(out), 3) is None  # a half-warp mask, kept
    assert (out[:16] == np.arange(16) ^ 1).all() and (out[16:32] == np.arange(16, 32)).all()
    err = call(lib.probe_shuffle, ptr(out), 4)
    assert err is not None and "lane 20, not in its mask" in err, err


def test_divergent_syncthreads(lib):
    out = np.zeros(128, np.float32)
    assert call(lib.probe_sync, ptr(out), 0) is None
    err = call(lib.probe_sync, ptr(out), 1)
    assert err is not None and "deadlock" in err and "64 wait at __syncthreads" in err, err
    assert "64 ended the block" in err, err


def test_uniform_assertion(lib):
    out = np.zeros(128, np.float32)
    assert call(lib.probe_uniform, ptr(out), 0) is None
    err = call(lib.probe_uniform, ptr(out), 1)
    assert err is not None and "GN_ASSERT_UNIFORM(32, v)" in err and "rules_probe.cu" in err, err
    assert call(lib.probe_uniform, ptr(out), 2) is None
    err = call(lib.probe_uniform, ptr(out), 3)
    assert err is not None and "thread 127" in err, err


def test_schedules_expose_a_race(lib, monkeypatch):
    got = {}
    for sched in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("GNMX_EMU_SCHED", sched)
        out = np.zeros(256, np.float32)
        assert call(lib.probe_race, ptr(out), 256) is None
        got[sched] = out
    fwd, rev = got["forward"], got["reverse"]
    # forward: thread t ran before t + 1 and reads the old 0 (but the barrier's last arriver, 255,
    # ran on first); reverse: after it, and reads t + 2 (but 0, the last arriver, ran on first)
    assert (fwd[:254] == 0).all() and (rev[1:255] == np.arange(3, 257)).all(), (fwd, rev)
    assert not np.array_equal(got["random:7"], fwd) and not np.array_equal(got["random:7"], rev)


def test_welford_butterfly_is_lane_uniform(lib):
    rng = np.random.default_rng(3)
    per_lane = 7
    for trial in range(4):
        x = (1000.0 + rng.standard_normal(32 * per_lane) * 10.0 ** -trial).astype(np.float32)
        out = np.zeros(32, np.float32)
        assert call(lib.probe_welford, ptr(x), per_lane, ptr(out), 0) is None
        assert (out.view(np.uint32) == out[0].view(np.uint32)).all()
        assert abs(float(out[0]) - float(x.astype(np.float64).mean())) < 1e-3
    # the butterfly the fix replaced leaves lanes with different last bits: the assertion sees it
    x = (1000.0 + rng.standard_normal(32 * per_lane)).astype(np.float32)
    err = call(lib.probe_welford, ptr(x), per_lane, ptr(out), 1)
    assert err is not None and "GN_ASSERT_UNIFORM(32, w)" in err, err
