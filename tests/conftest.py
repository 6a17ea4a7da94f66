"""Shared fixtures: contexts, seeds, one tolerance table keyed by dtype, subprocess runner."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx
import gn_mx  # noqa: F401  (loads the op library)

from tolerances import DTYPES, GRAD_TOL, TOL, tol  # noqa: F401,E402  (the one table)


def contexts():
    ctxs = [mx.cpu()]
    if mx.context.num_gpus() > 0:
        ctxs.append(mx.gpu(0))
    return ctxs


@pytest.fixture(params=contexts(), ids=lambda c: str(c))
def ctx(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(1234)
    mx.random.seed(1234)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, timeout=300, cwd=None):
    """Run `code` in a fresh interpreter (same venv); returns CompletedProcess (never raises)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or ROOT, env=env)


_RELOAD = """
import sys, numpy as np, mxnet as mx
import gn_mx
prefix, epoch, names, io = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
net = mx.gluon.SymbolBlock.imports(prefix + "-symbol.json", names,
                                   prefix + "-%04d.params" % epoch if epoch >= 0 else None)
exec(sys.argv[5])  # after_load
ins = np.load(io + "-in.npz")
outs = net(*[mx.nd.array(ins["a%d" % i], dtype=ins["a%d" % i].dtype) for i in range(len(names))])
outs = outs if isinstance(outs, (list, tuple)) else [outs]
np.savez(io + "-out.npz", *[o.asnumpy() for o in outs])
"""


def reload_outputs(prefix, inputs, input_names=("data",), epoch=0, after_load="", timeout=300):
    """The outputs of the model exported at ``prefix`` (``prefix-symbol.json`` and
    ``prefix-%04d.params`` % epoch; epoch -1: no params file) when a FRESH interpreter that only
    imports gn_mx loads it with ``gluon.SymbolBlock.imports`` and calls it on ``inputs`` (numpy
    arrays, one per input name, passed in their own dtype). ``after_load``: statements run on
    ``net`` first (e.g. ``net.cast('float64')``). A list of numpy arrays; fails the test with the
    child's stderr when the child fails. The one export -> reload -> compare path of the suite."""
    io = prefix + "-reload"
    np.savez(io + "-in.npz", **{f"a{i}": np.asarray(a) for i, a in enumerate(inputs)})
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run([sys.executable, "-c", _RELOAD, prefix, str(epoch), ",".join(input_names), io,
                        textwrap.dedent(after_load)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    assert p.returncode == 0, f"reloading {prefix} in a fresh process failed:\n{p.stderr[-3000:]}"
    with np.load(io + "-out.npz") as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def export_and_reload(block, inputs, path, rtol=1e-6, atol=1e-6, **kw):
    """Hybridize and run ``block`` on ``inputs`` (numpy), export it to ``path``/model, reload it in a
    fresh process (reload_outputs, ``kw`` passed on) and assert its outputs equal the block's within
    rtol / atol. Returns the export prefix (for checks of the symbol JSON)."""
    block.hybridize()
    outs = block(*[mx.nd.array(a, dtype=np.asarray(a).dtype) for a in inputs])
    outs = [o.asnumpy() for o in (outs if isinstance(outs, (list, tuple)) else [outs])]
    prefix = os.path.join(str(path), "model")
    block.export(prefix)
    got = reload_outputs(prefix, inputs, **kw)
    assert len(got) == len(outs), (len(got), len(outs))
    for g, want in zip(got, outs):
        np.testing.assert_allclose(g, want, rtol=rtol, atol=atol)
    return prefix


def rounded(a, dtype):
    """The array as the op sees it (rounded to dtype) and as float64 for the reference."""
    r = np.asarray(a).astype(dtype)
    return r, r.astype(np.float64)


def dbn_data(shape, dtype, offset=0.5):
    """Correlated, well-conditioned data for DBN tests: channel c mixes channel c-1."""
    x = np.random.randn(*shape)
    x[:, 1:] += 0.6 * x[:, :-1]
    return (x + offset).astype(dtype)


def check_bad_inputs(prelude, cases, survivor, survivor_out):
    """The one bad-input runner: every case of ``cases`` ({name: (statement, expected text)}) runs
    in ONE fresh interpreter after ``prelude``; each must raise MXNetError (or Gluon's ValueError
    wrapping the op's message) containing its expected text, and afterwards ``survivor`` (an
    expression) must still evaluate and print ``survivor_out``. A crash (segfault, abort) names the
    case that was running. Fails with one line per wrong case."""
    code = prelude
    for name, (stmt, _) in cases.items():
        body = textwrap.indent(textwrap.dedent(stmt).strip(), "    ")
        code += (f"\nprint('START {name}', flush=True)\ntry:\n{body}\n    mx.nd.waitall()\n"
                 f"    print('CASE {name} NO_ERROR', flush=True)\n"
                 f"except (mx.base.MXNetError, ValueError) as e:\n"
                 f"    print('CASE {name}', type(e).__name__, str(e).replace(chr(10), ' '),"
                 f" flush=True)\n")
    code += f"\nprint('ALIVE', {survivor})\n"
    p = run_python(code)
    out = p.stdout
    if p.returncode != 0:
        started = [ln.split()[1] for ln in out.splitlines() if ln.startswith("START ")]
        raise AssertionError(f"the interpreter died (exit {p.returncode}) in case "
                             f"{started[-1] if started else '?'}:\n{p.stderr[-3000:]}")
    assert f"ALIVE {survivor_out}" in out, out[-3000:]
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("CASE ")}
    failures = [f"{name}: want {want!r}; got {lines.get(name)!r}"[:600]
                for name, (_, want) in cases.items()
                if name not in lines or "NO_ERROR" in lines[name] or want not in lines[name]]
    assert not failures, "\n".join(failures)


def dbn_train_step(x, dy, G, dtype=None, **attrs):
    """One gn_dbn training call on x (running mean 0, running projection I, `attrs` such as eps /
    momentum, else the op's defaults) and its backward with head gradient dy, in `dtype` (default
    x's): (y, dx, the updated running projection) as numpy arrays."""
    from mxnet import autograd
    dtype = x.dtype if dtype is None else dtype
    C = x.shape[1]
    rm = mx.nd.zeros((C,), dtype=dtype)
    rp = mx.nd.array(np.tile(np.eye(C // G), (G, 1, 1)), dtype=dtype)
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, **attrs)[0]
    y.backward(mx.nd.array(dy, dtype=dtype))
    return y.asnumpy(), xs.grad.asnumpy(), rp.asnumpy()


def dbn_fd_check(x, G, eps=1e-5, rtol=1e-5, atol=1e-6, dy=None):
    """gn_dbn's float64 gradient vs central differences of its own forward (tests/reference.py's
    numeric_grad), for head gradient `dy` (random when None)."""
    from mxnet import autograd
    from reference import numeric_grad
    dy = np.random.randn(*x.shape) if dy is None else dy
    C = x.shape[1]
    rm = mx.nd.zeros((C,), dtype=np.float64)
    rp = mx.nd.array(np.tile(np.eye(C // G), (G, 1, 1)), dtype=np.float64)

    def f(z):
        return float((mx.nd.gn_dbn(mx.nd.array(z, dtype=np.float64), rm, rp, num_groups=G,
                                   eps=eps)[0].asnumpy() * dy).sum())

    xs = mx.nd.array(x, dtype=np.float64)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=eps)[0]
    y.backward(mx.nd.array(dy, dtype=np.float64))
    np.testing.assert_allclose(xs.grad.asnumpy(), numeric_grad(f, x), rtol=rtol, atol=atol)


@pytest.fixture
def np_mode():
    """The NumPy interface (npx.set_np()) for one test, legacy mode restored after it."""
    mx.npx.set_np()
    try:
        yield
    finally:
        mx.npx.reset_np()


def pytest_collection_modifyitems(session, config, items):
    """The full CUDA 11.8 resource audit (GNMX_AUDIT=1) starts in the background now and its test
    runs last (tests/audit_background.py)."""
    import audit_background
    audit_background.schedule(items)
