"""Loading libgn_mx.so in real processes (issue 9, item 1; issue 10's repeated-load defect).

- libgn_mx.so exports only the lib_api C entry points (no mxnet::ext C++ symbol), so its copy of
  lib_api.cc binds inside the library even when libmxnet.so (which exports its own copy) is in the
  global symbol scope: RTLD_GLOBAL before or after `import mxnet` (as horovod does), C programs.
- Loading it any number of times, directly with mx.library.load and through `import gn_mx`, in
  either order, is harmless.
- Another lib_api library (built here with the system compiler against the wheel's lib_api) loaded
  first, even with RTLD_GLOBAL: the ops of both work.

Each scenario runs in a fresh interpreter and then checks every op forward/backward against numpy
and an export/reload of a GroupNorm + DecorrelatedBatchNorm net (CHECK_OPS below).
"""
import os
import re
import shutil
import subprocess

import mxnet as mx
import pytest

import gn_mx
from conftest import run_python

MX_ROOT = os.path.dirname(os.path.abspath(mx.__file__))
LIBMXNET = os.path.join(MX_ROOT, "libmxnet.so")
ENTRY_POINT = re.compile(r"^(initialize|_op\w+|_part\w+|_pass\w+|_msg\w+|gnmx_build_info)$")

# Every op forward + backward against numpy, then export -> reload of a hybridized net with both
# blocks (after a training step, so DBN's running statistics are not the initial ones).
CHECK_OPS = r'''
import os, tempfile
import numpy as np
import mxnet as mx
import gn_mx
rng = np.random.RandomState(0)
A = lambda a: mx.nd.array(a, dtype=a.dtype)
N, C, S, G = 4, 6, 5, 3
x_np = rng.randn(N, C, S).astype(np.float32)
g_np = (rng.rand(C) + 0.5).astype(np.float32)
b_np = rng.randn(C).astype(np.float32)
dy_np = rng.randn(N, C, S).astype(np.float32)
x, gamma, beta, dy = A(x_np), A(g_np), A(b_np), A(dy_np)
for a in (x, gamma, beta):
    a.attach_grad()
xg = x_np.reshape(N, G, -1).astype(np.float64)
mu, var = xg.mean(-1), xg.var(-1)
xhat = ((xg - mu[..., None]) / np.sqrt(var[..., None] + 1e-5)).reshape(N, C, S)
close = lambda a, b, tol=1e-5: np.abs(a.asnumpy() - b).max() <= tol

# gn_moments: d/dx sum(2*mean + var) = 2/n + 2 (x - mu) / n
with mx.autograd.record():
    m, v = mx.nd.gn_moments(x, num_groups=G)
    loss = (2 * m + v).sum()
loss.backward()
n = xg.shape[-1]
assert close(m, mu) and close(v, var), "gn_moments forward"
assert close(x.grad, (2.0 / n + 2 * (xg - mu[..., None]) / n).reshape(N, C, S)), "gn_moments backward"

# gn_group_norm
with mx.autograd.record():
    y = mx.nd.gn_group_norm(x, gamma, beta, num_groups=G, eps=1e-5)[0]
y.backward(dy)
assert close(y, xhat * g_np[:, None] + b_np[:, None]), "gn_group_norm forward"
assert close(beta.grad, dy_np.sum((0, 2)), 1e-4) and close(gamma.grad, (dy_np * xhat).sum((0, 2)), 1e-4)

# gn_channel_affine
with mx.autograd.record():
    y = mx.nd.gn_channel_affine(x, gamma, beta)
y.backward(dy)
assert close(y, x_np * g_np[:, None] + b_np[:, None]), "gn_channel_affine forward"
assert close(x.grad, dy_np * g_np[:, None]) and close(gamma.grad, (dy_np * x_np).sum((0, 2)), 1e-4)

# gn_dbn (training): whitened groups, running mean updated in place, translation-invariant grad
rm = mx.nd.zeros(C)
rp = mx.nd.array(np.tile(np.eye(2, dtype=np.float32), (G, 1, 1)))
xd_np = (rng.randn(64, C) * [1, 2, 3, 1, 2, 3] + 1).astype(np.float32)
xd = A(xd_np)
xd.attach_grad()
with mx.autograd.record():
    w = mx.nd.gn_dbn(xd, rm, rp, num_groups=G, eps=1e-5, momentum=0.5)[0]
w.backward(A(rng.randn(64, C).astype(np.float32)))
wn = w.asnumpy().reshape(64, G, 2)
for gi in range(G):
    assert np.abs(np.cov(wn[:, gi].T, bias=True) - np.eye(2)).max() < 1e-3, "gn_dbn whitening"
assert close(rm, 0.5 * xd_np.mean(0)), "gn_dbn running_mean"
assert np.abs(xd.grad.asnumpy().sum(0)).max() < 1e-3, "gn_dbn backward"

# gn_dbn_inference: out = P_g (x_g - m_g), dx = P^T dy
P, mm = rp.asnumpy(), rm.asnumpy()
with mx.autograd.record():
    o = mx.nd.gn_dbn_inference(xd, rm, rp, num_groups=G)
ddy = rng.randn(64, C).astype(np.float32)
o.backward(A(ddy))
ref = np.einsum("gij,ngj->ngi", P, (xd_np - mm).reshape(64, G, 2)).reshape(64, C)
assert close(o, ref), "gn_dbn_inference forward"
assert close(xd.grad, np.einsum("gji,ngj->ngi", P, ddy.reshape(64, G, 2)).reshape(64, C)), "gn_dbn_inference backward"

# export -> reload
net = mx.gluon.nn.HybridSequential()
net.add(mx.gluon.nn.Conv1D(6, 3), gn_mx.GroupNorm(num_groups=3), gn_mx.DecorrelatedBatchNorm(num_groups=3))
net.initialize()
net.hybridize()
xb = mx.nd.array(rng.randn(8, 2, 7))
with mx.autograd.record():
    net(xb).sum().backward()
want = net(xb).asnumpy()
d = tempfile.mkdtemp()
net.export(os.path.join(d, "net"))
blk = mx.gluon.SymbolBlock.imports(os.path.join(d, "net-symbol.json"), ["data"],
                                   os.path.join(d, "net-0000.params"))
assert np.abs(blk(xb).asnumpy() - want).max() <= 1e-6, "export/reload"
print("CHECK-OPS-OK")
'''

# libmxnet.so in the global scope BEFORE other extensions load breaks some of them, without gn_mx:
# it exports its bundled protobuf, and onnx's extension binds to it (segfault inside `import onnx`,
# which `import mxnet` runs when onnx is installed); numpy imported after it crashes in np.dot /
# np.cov about half the time. These are MXNet/numpy/onnx clashes, not gn_mx's, so the
# RTLD_GLOBAL-first scenario imports numpy first and hides onnx.
GLOBAL_FIRST = "import sys; sys.modules['onnx'] = None\nimport numpy\n"


def _run(prelude):
    p = run_python(prelude + CHECK_OPS, timeout=240)
    assert p.returncode == 0 and "CHECK-OPS-OK" in p.stdout, (
        f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def test_exports_only_lib_api_entry_points():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", gn_mx.library_path()], capture_output=True,
                         text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    for needed in ("initialize", "_opVersion", "_opRegSize", "_opRegGet", "_opCallFCompute",
                   "_msgSize", "_msgGet"):
        assert needed in names, (needed, names)
    assert [n for n in names if not ENTRY_POINT.match(n)] == [], names
    demangled = subprocess.run([nm, "-D", "-C", "--defined-only", gn_mx.library_path()],
                               capture_output=True, text=True, check=True).stdout
    assert "mxnet::ext" not in demangled


def test_libmxnet_global_before_import_mxnet():
    _run(GLOBAL_FIRST + f"""
import ctypes
ctypes.CDLL({LIBMXNET!r}, ctypes.RTLD_GLOBAL)
import mxnet
import gn_mx
assert "gn_mx.onnx" not in sys.modules  # without onnx, import gn_mx works and skips ONNX
""")


def test_libmxnet_global_after_import_mxnet():
    _run(f"""
import ctypes
import mxnet
ctypes.CDLL({LIBMXNET!r}, ctypes.RTLD_GLOBAL)
import gn_mx
""")


def test_direct_loads_then_import():
    # The library loaded three times by hand (MXNet alone used to fail on the third:
    # "... of operator gn_dbn is already registered"), then imported, then loaded again.
    _run(f"""
import mxnet as mx
for _ in range(3):
    mx.library.load({gn_mx.library_path()!r}, verbose=False)
import gn_mx
mx.library.load(gn_mx.library_path(), verbose=False)
mx.library.load(gn_mx.library_path())
gn_mx._library.load()
""")


def test_import_then_direct_loads():
    _run("""
import importlib
import mxnet as mx
import gn_mx
for _ in range(3):
    mx.library.load(gn_mx.library_path(), verbose=False)
importlib.reload(gn_mx._library)
gn_mx._library.load()
""")


TINY_OP = r"""
// A minimal third-party lib_api library: tiny_triple(x) = 3 x (float32), with backward.
#include "lib_api.h"
using namespace mxnet::ext;
typedef std::unordered_map<std::string, std::string> Attrs;
static MXReturnValue parse(const Attrs&, int* ni, int* no) { *ni = 1; *no = 1; return MX_SUCCESS; }
static MXReturnValue type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kFloat32) { MX_ERROR_MSG << "tiny_triple: float32 only"; return MX_FAIL; }
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}
static MXReturnValue shape(const Attrs&, std::vector<std::vector<unsigned int>>* in,
                           std::vector<std::vector<unsigned int>>* out) {
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}
static MXReturnValue fwd(const Attrs&, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                         const OpResource&) {
  const float* x = (*in)[0].data<float>();
  float* y = (*out)[0].data<float>();
  for (int64_t i = 0; i < (*in)[0].size(); ++i) y[i] = 3.f * x[i];
  return MX_SUCCESS;
}
static MXReturnValue bwd(const Attrs&, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                         const OpResource&) {
  const float* dy = (*in)[0].data<float>();
  float* dx = (*out)[0].data<float>();
  for (int64_t i = 0; i < (*out)[0].size(); ++i) dx[i] = 3.f * dy[i];
  return MX_SUCCESS;
}
REGISTER_OP(tiny_triple).setParseAttrs(parse).setInferType(type).setInferShape(shape)
    .setForward(fwd, "cpu").setBackward(bwd, "cpu");
MXReturnValue initialize(int version) { return MX_SUCCESS; }
"""


@pytest.fixture(scope="module")
def tiny_lib(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler (g++/c++) to build the test's lib_api library")
    d = tmp_path_factory.mktemp("tiny_lib")
    src = d / "tiny.cc"
    src.write_text(TINY_OP)
    lib = d / "libtiny.so"
    # Built like a typical third-party library: default visibility, so its own mxnet::ext copy is
    # exported (and, with RTLD_GLOBAL below, sits in the global scope next to ours).
    cmd = [cxx, "-std=c++17", "-O0", "-shared", "-fPIC", f"-I{MX_ROOT}/include",
           f"-I{MX_ROOT}/include/mxnet", str(src), os.path.join(MX_ROOT, "src", "lib_api.cc"),
           "-o", str(lib)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return str(lib)


def test_other_lib_api_library_loaded_first(tiny_lib):
    p = _run(f"""
import ctypes
import numpy as np
import mxnet as mx
ctypes.CDLL({tiny_lib!r}, ctypes.RTLD_GLOBAL)
mx.library.load({tiny_lib!r}, verbose=False)
import gn_mx
x = mx.nd.array(np.arange(24, dtype=np.float32).reshape(2, 4, 3))
x.attach_grad()
with mx.autograd.record():
    y = mx.nd.tiny_triple(x)
    z = mx.nd.gn_group_norm(y, mx.nd.ones(4), mx.nd.zeros(4), num_groups=2)[0]
    loss = (y * 2).sum() + (z * z).sum()
loss.backward()
assert np.allclose(y.asnumpy(), 3 * x.asnumpy())
# d/dx [2 sum(3x) + sum(GN(3x)^2)]: GN's output sum of squares is constant (= count), so 6
assert np.abs(x.grad.asnumpy() - 6).max() < 1e-3, x.grad
print("TINY-OK", flush=True)
""")
    assert "TINY-OK" in p.stdout
