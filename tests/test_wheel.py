"""Install test of the binary wheel (issue 20), with no build tools.

A CPU-only wheel built by tools/build_wheel.sh --cpu (the same script as the CPU+CUDA release wheel,
CUDA off; cached under build/wheel-test/<hash of the sources>) is installed into a fresh venv that
holds only mxnet==1.9.1, numpy<1.24 and the wheel, on the oldest and the newest Python that
setup.py's python_requires claims (skipped for an interpreter the machine lacks; GNMX_WHEEL_PYTHONS
lists others), with PATH = the venv's bin + an empty folder (no cc / c++ / cmake / nvcc), from a
neutral directory, and runs:
  - every op forward + backward against numpy (test_loading.CHECK_OPS, the same script);
  - a hybridized net exported in one process and reloaded in a fresh one;
  - gn_mx.build_info() (CPU only, this gn_mx version, MXNet's lib_api version);
  - every level of the run-time ISA dispatch the CPU has (generic, avx2, avx512, forced by
    GNMX_CPU_ISA) giving the same GroupNorm / DBN results;
  - a forked gluon DataLoader worker calling an op after the parent did (one OpenMP runtime:
    libgomp.so.1 is kept external, as MXNet's own wheel does);
  - the README quickstart.
The wheel's name carries the manylinux2014 tag; its symbol versions are checked by
tests/test_wheel_symbols.py, and the same smoke runs on Debian bullseye in
tests/test_wheel_bullseye.py (GNMX_BULLSEYE=1).
"""
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from conftest import ROOT
from test_loading import CHECK_OPS

BUILD_INPUTS = ("src", "python", "CMakeLists.txt", "setup.py", "pyproject.toml",
                "tools", "README.md")


def _python_range():
    """(oldest, newest) Python of setup.py's python_requires ('>=3.8,<3.12' -> 3.8, 3.11)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        m = re.search(r'python_requires=">=3\.(\d+),<3\.(\d+)"', f.read())
    assert m, "setup.py: python_requires is not of the form '>=3.X,<3.Y'"
    return f"3.{m.group(1)}", f"3.{int(m.group(2)) - 1}"


def _interpreter(version):
    for cand in sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}")) + [
            shutil.which(f"python{version}")]:
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


PYTHONS = os.environ.get("GNMX_WHEEL_PYTHONS", " ".join(_python_range())).split()
WHEEL_TOOLS_MIN_MINOR = 9  # tools/build_wheel.sh's tools: auditwheel >= 6.2 needs Python >= 3.9


def wheel_build_env(**extra):
    """The environment for tools/build_wheel.sh. Its build tools live in this interpreter's venv;
    below Python 3.9 (the wheel serves 3.8, its tools need 3.9) in a venv of the newest claimed
    Python found here, .toolchains/wheel-venv-3.X (skips without one)."""
    env = dict(os.environ, GNMX_JOBS=os.environ.get("GNMX_JOBS", "2"), **extra)
    if sys.version_info >= (3, WHEEL_TOOLS_MIN_MINOR):
        env["GNMX_WHEEL_VENV"] = sys.prefix
        return env
    newest = int(_python_range()[1].split(".")[1])
    for minor in range(newest, WHEEL_TOOLS_MIN_MINOR - 1, -1):
        cand = _interpreter(f"3.{minor}")
        if cand:
            env["PYTHON"] = cand
            env["GNMX_WHEEL_VENV"] = os.path.join(ROOT, ".toolchains", f"wheel-venv-3.{minor}")
            return env
    pytest.skip(f"building the wheel needs Python >= 3.{WHEEL_TOOLS_MIN_MINOR} for its tools "
                f"(auditwheel >= 6.2); none found beside this {sys.version.split()[0]}")


def wheel_tools_bin():
    """The bin folder of the venv that holds auditwheel for the build (wheel_build_env's)."""
    return os.path.join(wheel_build_env()["GNMX_WHEEL_VENV"], "bin")


def _source_hash():
    h = hashlib.sha256()
    for top in BUILD_INPUTS:
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
            if not f.endswith((".so", ".pyc")) and "egg-info" not in d and "__pycache__" not in d)
        for f in files:
            h.update(os.path.relpath(f, ROOT).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def wheel():
    """The CPU-only wheel of the current sources (built once per source state)."""
    if shutil.which("g++") is None:
        pytest.skip("building the wheel needs a C++ compiler")
    out = os.path.join(ROOT, "build", "wheel-test", _source_hash())
    found = glob.glob(os.path.join(out, "gn_mx-*.whl"))
    if not found:
        env = wheel_build_env(GNMX_WHEEL_OUT=out)
        r = subprocess.run(["bash", os.path.join(ROOT, "tools", "build_wheel.sh"), "--cpu"],
                           capture_output=True, text=True, env=env, timeout=1800)
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
        found = glob.glob(os.path.join(out, "gn_mx-*.whl"))
    assert len(found) == 1, found
    return found[0]


# The platform tag auditwheel writes for manylinux2014 (glibc 2.17: the tag of MXNet's 1.9.1 wheels).
MANYLINUX2014_TAG = "manylinux2014_x86_64.manylinux_2_17_x86_64"


def test_wheel_is_one_py3_none_manylinux2014_wheel(wheel):
    name = os.path.basename(wheel)
    m = re.match(r"gn_mx-([^-]+)-py3-none-([a-z0-9_.]+)\.whl$", name)
    assert m, name
    assert sorted(m.group(2).split(".")) == sorted(MANYLINUX2014_TAG.split(".")), name
    with open(os.path.join(ROOT, "python", "gn_mx", "__init__.py")) as f:
        assert f'__version__ = "{m.group(1)}"' in f.read()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "gn_mx/libgn_mx.so" in names
    # python -m gn_mx.selftest and the one edge-case list / float64 references it runs.
    for mod in ("selftest", "_edge_cases", "_reference", "_tolerances"):
        assert f"gn_mx/{mod}.py" in names, mod
    assert not [n for n in names if ".libs/" in n], names  # nothing vendored (libgomp external)
    assert "License: Apache-2.0" in meta and "Requires-Python: >=3.8,<3.12" in meta, meta[:1500]
    sums = open(os.path.join(os.path.dirname(wheel), "SHA256SUMS")).read().split()
    with open(wheel, "rb") as f:
        assert sums == [hashlib.sha256(f.read()).hexdigest(), name]


FORK_LOADER = r'''
import os, numpy as np, mxnet as mx, gn_mx
from mxnet import gluon
G = 3
def gn(a):  # runs in the forked worker: an op call with OpenMP after the parent's
    y = mx.nd.gn_group_norm(mx.nd.array(a[None]), mx.nd.ones(6), mx.nd.zeros(6), num_groups=G)[0]
    return y[0].asnumpy(), np.float32(os.getpid())
x = np.random.RandomState(0).randn(12, 6, 5).astype(np.float32)
mx.nd.gn_group_norm(mx.nd.array(x), mx.nd.ones(6), mx.nd.zeros(6), num_groups=G)[0].wait_to_read()
loader = gluon.data.DataLoader(gluon.data.ArrayDataset(x).transform(gn), batch_size=4,
                               num_workers=2)
xg = x.reshape(12, G, -1).astype(np.float64)
ref = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
got, pids = zip(*[(y.asnumpy(), p.asnumpy()) for y, p in loader])
assert np.abs(np.concatenate(got) - ref).max() < 1e-5
assert os.getpid() not in set(np.concatenate(pids).astype(int).tolist()), "not run in a worker"
gomp = {l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l}
assert len(gomp) == 1, gomp  # one OpenMP runtime in the process
print("FORK-OK")
'''

EXPORT = r'''
import os, sys, numpy as np, mxnet as mx, gn_mx
net = mx.gluon.nn.HybridSequential()
net.add(mx.gluon.nn.Conv2D(8, 3, padding=1), gn_mx.GroupNorm(num_groups=4, activation="silu"),
        gn_mx.DecorrelatedBatchNorm(num_groups=2), mx.gluon.nn.GlobalAvgPool2D())
net.initialize(mx.init.Xavier())
net.hybridize()
x = mx.nd.array(np.random.RandomState(1).randn(4, 3, 6, 6))
with mx.autograd.record():
    net(x).sum().backward()
net.export(os.path.join(sys.argv[1], "net"))
np.save(os.path.join(sys.argv[1], "x.npy"), x.asnumpy())
np.save(os.path.join(sys.argv[1], "y.npy"), net(x).asnumpy())
print("EXPORT-OK")
'''

RELOAD = r'''
import os, sys, numpy as np, mxnet as mx, gn_mx
d = sys.argv[1]
blk = mx.gluon.SymbolBlock.imports(os.path.join(d, "net-symbol.json"), ["data"],
                                   os.path.join(d, "net-0000.params"))
y = blk(mx.nd.array(np.load(os.path.join(d, "x.npy")))).asnumpy()
assert np.abs(y - np.load(os.path.join(d, "y.npy"))).max() <= 1e-6
print("RELOAD-OK")
'''

# The run-time ISA dispatch (cpu_isa.h) in the wheel's library: the path build_info() names, and
# the same GroupNorm / DBN (ZCA, IterNorm) results from every level the CPU has (GNMX_CPU_ISA,
# read once at the first call). argv: 'default' or a level (generic, avx2, avx512), then an output .npz.
ISA = r'''
import os, sys, json
if sys.argv[1] != "default":
    os.environ["GNMX_CPU_ISA"] = sys.argv[1]
import numpy as np, mxnet as mx, gn_mx
info = gn_mx.build_info()
rs = np.random.RandomState(3)
x = mx.nd.array(rs.randn(4, 32, 9, 7))
x.attach_grad()
outs = {"gn": mx.nd.gn_group_norm(x, mx.nd.ones(32), mx.nd.zeros(32), num_groups=8)[0]}
for name, blk in (("zca", gn_mx.DecorrelatedBatchNorm(num_groups=2)),
                  ("itn", gn_mx.DecorrelatedBatchNorm(num_groups=2, whitening="iternorm"))):
    blk.initialize()
    with mx.autograd.record():
        y = blk(x)
    y.backward(mx.nd.array(rs.randn(*y.shape)))
    outs[name], outs[name + "_dx"] = y, x.grad.copy()
np.savez(sys.argv[2], **{k: v.asnumpy() for k, v in outs.items()})
print("ISA " + json.dumps([info["cpu_isa"], info["cpu_isa_active"]]))
'''


INFO = r'''
import json, gn_mx
print("INFO " + json.dumps(gn_mx.build_info()))
'''


@pytest.fixture(scope="module", params=PYTHONS)
def installed(request, wheel, tmp_path_factory):
    """A fresh venv on that Python with only mxnet==1.9.1, numpy<1.24 and the wheel."""
    py = _interpreter(request.param)
    if py is None:
        pytest.skip(f"no Python {request.param} interpreter on this machine")
    venv = str(tmp_path_factory.mktemp(f"wheel-py{request.param}") / "venv")
    subprocess.run([py, "-m", "venv", venv], check=True, timeout=300)
    vpy = os.path.join(venv, "bin", "python")
    r = subprocess.run([vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "mxnet==1.9.1", "numpy<1.24", wheel], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return vpy


def _run(vpy, code, tmp_path, *args):
    """Run `code` with the installed venv from a neutral folder, no build tools on PATH."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    path = f"{os.path.dirname(vpy)}:{empty}"
    for tool in ("cc", "c++", "gcc", "g++", "cmake", "nvcc"):
        assert shutil.which(tool, path=path) is None, tool
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GNMX_", "VIRTUAL"))}
    env.update(PATH=path, OMP_NUM_THREADS="2", HOME=str(tmp_path))
    work = tmp_path / "neutral"
    work.mkdir(exist_ok=True)
    return subprocess.run([vpy, "-c", textwrap.dedent(code)] + list(args), capture_output=True,
                          text=True, timeout=300, cwd=str(work), env=env)


# The smoke itself, one function per check, each given `run(code, *args)` (a CompletedProcess of
# `python -c code args` with the installed wheel): here a venv on this machine, in
# tests/test_wheel_bullseye.py a venv inside a Debian bullseye root.
def check_every_op(run):
    r = run("import gn_mx, os\nassert 'site-packages' in gn_mx.__file__, gn_mx.__file__\n" + CHECK_OPS)
    assert r.returncode == 0 and "CHECK-OPS-OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def check_export_and_reload(run, model_dir):
    """Export in one process, reload in a fresh one; `model_dir` as the running process sees it."""
    r = run(EXPORT, model_dir)
    assert r.returncode == 0 and "EXPORT-OK" in r.stdout, r.stderr[-4000:]
    r = run(RELOAD, model_dir)
    assert r.returncode == 0 and "RELOAD-OK" in r.stdout, r.stderr[-4000:]


def check_build_info(run, cuda):
    r = run(INFO)
    assert r.returncode == 0, r.stderr[-4000:]
    info = json.loads(r.stdout.split("INFO ", 1)[1])
    with open(os.path.join(ROOT, "python", "gn_mx", "__init__.py")) as f:
        version = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)
    assert info["version"] == version and info["lib_api"] == 11, info
    assert info["mxnet"].startswith("mxnet 1.9") and info["openmp"] > 0, info
    if cuda:
        assert info["cuda"]["runtime"] == "11.8" and "CUDA 11.8" in info["summary"], info
    else:
        assert info["cuda"] is None and "CPU only" in info["summary"], info
    return info


def check_cpu_isa(run, out_dir, levels=("generic",)):
    """Every level of the ISA dispatch gives the same results; the active one is what the CPU has."""
    got = {}
    for isa in ("default",) + tuple(levels):
        r = run(ISA, isa, f"{out_dir}/{isa}.npz")
        assert r.returncode == 0 and "ISA " in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
        got[isa] = json.loads(r.stdout.split("ISA ", 1)[1])
    return got


def check_forked_loader(run):
    r = run(FORK_LOADER)
    assert r.returncode == 0 and "FORK-OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def check_quickstart(run):
    """The README's quickstart, as a user runs it."""
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        code = f.read()
    r = run(code)
    assert r.returncode == 0 and "-> OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_installed_wheel_runs_every_op_without_build_tools(installed, tmp_path):
    check_every_op(lambda code, *a: _run(installed, code, tmp_path, *a))


def test_installed_wheel_export_and_reload_in_a_fresh_process(installed, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    check_export_and_reload(lambda code, *a: _run(installed, code, tmp_path, *a), str(d))


def test_installed_wheel_build_info(installed, tmp_path):
    check_build_info(lambda code, *a: _run(installed, code, tmp_path, *a), cuda=False)


def test_installed_wheel_cpu_isa_dispatch(installed, tmp_path):
    import numpy as np
    from test_cpu_isa import cpu_isa_levels
    levels = cpu_isa_levels()
    got = check_cpu_isa(lambda code, *a: _run(installed, code, tmp_path, *a), str(tmp_path), levels)
    compiled = ["generic", "avx2", "avx512"]
    assert got["default"] == [compiled, levels[-1]], got
    a = np.load(tmp_path / "default.npz")
    for level in levels:
        assert got[level] == [compiled, level], got
        b = np.load(tmp_path / f"{level}.npz")
        for k in a.files:
            assert np.allclose(a[k], b[k], rtol=1e-4, atol=1e-4), (level, k, np.abs(a[k] - b[k]).max())


def test_installed_wheel_runs_its_selftest(installed, tmp_path):
    """python -m gn_mx.selftest from the installed wheel alone (no source tree on the path)."""
    code = ("import subprocess, sys\n"
            "sys.exit(subprocess.call([sys.executable, '-m', 'gn_mx.selftest', '--no-timing']))\n")
    r = _run(installed, code, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gn_mx selftest: PASSED" in r.stdout and "edge cases (" in r.stdout, r.stdout[-3000:]


def test_installed_wheel_forked_loader_after_an_op_call(installed, tmp_path):
    check_forked_loader(lambda code, *a: _run(installed, code, tmp_path, *a))


def test_installed_wheel_runs_the_quickstart(installed, tmp_path):
    """The README's quickstart, as a user runs it: the installed wheel, no compiler on PATH."""
    check_quickstart(lambda code, *a: _run(installed, code, tmp_path, *a))
