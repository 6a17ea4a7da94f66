"""The shared numerical edge cases (tests/edge_cases.py) on the MXNet ops, every context.

The same list runs on the CUDA kernels through tests/gpu/test_gpu_edge_cases.py (a real GPU, or the
CPU emulator in CI), so a guarantee stated there holds on both devices or CI fails.
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import edge_cases


class MxRunner:
    """edge_cases' runner interface on mx.nd.gn_group_norm / gn_moments on `ctx`."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.name = str(ctx)

    def _nd(self, a, dtype=None):
        a = np.asarray(a)
        return mx.nd.array(a, ctx=self.ctx, dtype=dtype or a.dtype)

    def group_norm(self, x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None,
                   axis=1):
        xs, gs, bs = self._nd(x), self._nd(gamma), self._nd(beta)
        for a in (xs, gs, bs):
            a.attach_grad()
        kw = {} if act is None else {"act_type": act}
        kw.update({} if axis == 1 else {"axis": axis})
        with autograd.record():
            y, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps, **kw)
        res = {"y": y, "mean": mean, "rstd": rstd}
        if dy is not None:
            heads, grads = [y], [self._nd(dy)]
            if dmean is not None or drstd is not None:
                zero = np.zeros(mean.shape)
                heads += [mean, rstd]
                grads += [self._nd(zero if dmean is None else dmean, mean.dtype),
                          self._nd(zero if drstd is None else drstd, rstd.dtype)]
            autograd.backward(heads, grads)
            res.update(dx=xs.grad, dgamma=gs.grad, dbeta=bs.grad)
        return {k: v.asnumpy() for k, v in res.items()}

    def moments(self, x, G, dmean=None, dvar=None, axis=1):
        xs = self._nd(x)
        xs.attach_grad()
        kw = {} if axis == 1 else {"axis": axis}
        with autograd.record():
            mean, var = mx.nd.gn_moments(xs, num_groups=G, **kw)
        res = {"mean": mean, "var": var}
        if dmean is not None:
            autograd.backward([mean, var], [self._nd(dmean, mean.dtype), self._nd(dvar, var.dtype)])
            res["dx"] = xs.grad
        return {k: v.asnumpy() for k, v in res.items()}


@pytest.mark.parametrize("case", edge_cases.CASES, ids=edge_cases.case_id)
def test_edge_case(ctx, case):
    case(MxRunner(ctx))


LAYOUT_CASES = list(edge_cases.CASES) + edge_cases.LAYOUT_EXTRA_CASES


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=edge_cases.case_id)
def test_edge_case_channels_last(ctx, case):
    """The same list on channels-last data (axis=-1; edge_cases.ChannelsLast)."""
    case(edge_cases.channels_last(MxRunner(ctx)))


@pytest.mark.parametrize("case", edge_cases.LAYOUT_EXTRA_CASES, ids=edge_cases.case_id)
def test_edge_case_layout_extra(ctx, case):
    case(MxRunner(ctx))
