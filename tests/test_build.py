"""Build options that must keep working: GNMX_OPENMP=OFF links and runs, single-threaded.

The library is configured and built from scratch in a temporary directory (-O0, CPU only: ~10 s)
and loaded in a fresh interpreter that never imports gn_mx (so its op names are free).
"""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run_python


@pytest.fixture(scope="module")
def no_openmp_lib(tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH")
    build = tmp_path_factory.mktemp("build_no_openmp")
    cfg = ["cmake", "-S", ROOT, "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}",
           "-DGNMX_OPENMP=OFF", "-DGNMX_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Debug",
           "-DCMAKE_CXX_FLAGS_DEBUG=-O0"]
    r = subprocess.run(cfg, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gn_mx: OpenMP OFF" in r.stdout
    r = subprocess.run(["cmake", "--build", str(build), "--target", "gn_mx", "-j", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return os.path.join(str(build), "libgn_mx.so")


def test_openmp_off_links_without_libgomp(no_openmp_lib):
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not on PATH")
    r = subprocess.run(["readelf", "-d", "-s", "--wide", no_openmp_lib], capture_output=True,
                       text=True, check=True)
    assert "libgomp" not in r.stdout and "libomp" not in r.stdout
    assert "GOMP_" not in r.stdout and "omp_get_" not in r.stdout


def test_openmp_off_ops_match_reference(no_openmp_lib):
    r = run_python(f"""
        import numpy as np, mxnet as mx
        mx.library.load({no_openmp_lib!r}, verbose=False)
        rng = np.random.RandomState(0)
        # large enough that the OpenMP build would split the work across threads
        x = rng.randn(4, 16, 32, 32) * 3 + 5
        g, b = rng.rand(16) + 0.5, rng.randn(16)
        y = mx.nd.gn_group_norm(mx.nd.array(x, dtype='float64'), mx.nd.array(g, dtype='float64'),
                                mx.nd.array(b, dtype='float64'), num_groups=4)[0].asnumpy()
        xg = x.reshape(4, 4, -1)
        ref = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5)
        ref = ref.reshape(x.shape) * g[:, None, None] + b[:, None, None]
        err_gn = np.abs(y - ref).max()
        # DBN: whitened groups have identity covariance (up to eps)
        rm = mx.nd.zeros(16, dtype='float64')
        rp = mx.nd.array(np.stack([np.eye(4)] * 4), dtype='float64')
        o = mx.nd.gn_dbn(mx.nd.array(x, dtype='float64'), rm, rp, num_groups=4,
                         eps=1e-12)[0].asnumpy()
        og = o.transpose(1, 0, 2, 3).reshape(4, 4, -1)
        cov = np.einsum('gdm,gem->gde', og, og) / og.shape[-1]
        err_dbn = np.abs(cov - np.eye(4)).max()
        print('ERR', err_gn, err_dbn)
        assert err_gn < 1e-10, err_gn
        assert err_dbn < 1e-8, err_dbn
        print('OK')
    """, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _listed_cuda_sources():
    kdir = os.path.join(ROOT, "src", "operator", "kernels")
    with open(os.path.join(kdir, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    return kdir, [n for n in names if n]


def test_cuda_source_list_matches_the_kernels_folder():
    # The one list that CMake, tests/gpu/build.sh (nvcc fallback) and the CPU emulator read.
    kdir, names = _listed_cuda_sources()
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(f for f in os.listdir(kdir) if f.endswith(".cu"))


def test_configure_without_mxnet(tmp_path):
    # GNMX_MXNET=OFF (the GPU machine: nvcc + torch, no MXNet): no `import mxnet`, no op library.
    # Any interpreter that tried to import mxnet here would fail on the fake package below.
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH")
    fake = tmp_path / "no_mxnet" / "mxnet"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('GNMX_MXNET=OFF must not import mxnet')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "no_mxnet"))
    r = subprocess.run(["cmake", "-S", ROOT, "-B", str(tmp_path / "build"), "-DGNMX_MXNET=OFF",
                        "-DGNMX_CUDA=OFF"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gn_mx: MXNet OFF" in r.stdout
    assert "CUDA build:" not in r.stdout and "building against" not in r.stdout
    r = subprocess.run(["cmake", "--build", str(tmp_path / "build"), "--target", "help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    targets = {line.split()[-1] for line in r.stdout.splitlines() if line.startswith("...")}
    assert "gn_mx_kernels" in targets and "gn_mx" not in targets, targets


# ---- build_info() and the MXNet version check (issue 20 item 2, issue 22 item 3) --------------

def test_build_info_describes_the_loaded_library():
    import mxnet as mx
    import gn_mx
    from gn_mx import _library
    info = gn_mx.build_info()
    assert info["version"] == gn_mx.__version__
    assert info["mxnet"] == f"mxnet {mx.__version__}", info  # the CPU mxnet of this venv
    assert info["lib_api"] == _library.mxnet_lib_api_version(mx) == 11, info
    assert info["build_type"] and info["compiler"].split()[0] in ("gcc", "clang"), info
    assert "generic" in info["cpu_isa"] and info["cpu_isa_active"] in info["cpu_isa"], info
    nm = shutil.which("nm")
    if nm:  # CUDA kernels in the library <=> build_info reports a CUDA runtime
        syms = subprocess.run([nm, "-C", gn_mx.library_path()], capture_output=True, text=True).stdout
        has_cuda = "gn_mx::group_norm_fwd_cuda" in syms
        assert (info["cuda"] is not None) == has_cuda, info
    if info["cuda"] is None:
        assert "CPU only" in info["summary"], info
    else:
        assert info["cuda"]["sass"] and info["cuda"]["ptx"], info


def test_unsupported_mxnet_versions_are_named():
    import gn_mx
    from gn_mx._library import check_mxnet
    info = gn_mx.build_info()
    assert check_mxnet("1.9.1", 11, info) is None
    assert check_mxnet("1.9.0", None, info) is None  # header not found: the release decides
    msg = check_mxnet("1.8.0", 10, info)
    assert "needs MXNet 1.9" in msg and "mxnet 1.8.0 is installed (lib_api version 10)" in msg, msg
    assert f"lib_api version {info['lib_api']}" in msg and "mxnet==1.9.1" in msg, msg
    msg = check_mxnet("1.9.1", 12, info)
    assert "mxnet 1.9.1 has lib_api version 12" in msg and "lib_api version 11)" in msg, msg
    msg = check_mxnet("2.0.0", None, info)
    assert "mxnet 2.0.0 is installed (lib_api version unknown)" in msg, msg


def test_import_with_another_mxnet_release_raises_import_error():
    p = run_python("""
        import mxnet
        mxnet.__version__ = "1.8.0"
        try:
            import gn_mx
        except ImportError as e:
            print("IMPORT-ERROR", e)
    """)
    assert "IMPORT-ERROR" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "needs MXNet 1.9" in p.stdout and "mxnet 1.8.0 is installed" in p.stdout, p.stdout
