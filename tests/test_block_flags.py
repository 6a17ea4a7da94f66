"""Every switch of the Gluon blocks on its own: ``center`` alone decides whether beta learns, ``scale``
alone whether gamma learns, for GroupNorm and DecorrelatedBatchNorm, imperative and hybridized.
A test that turns both off together cannot tell the two apart."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from reference import dbn_ref, group_norm_ref

CPU = mx.cpu()
C, G = 4, 2
FLAGS = [(True, True), (True, False), (False, True), (False, False)]


def _block(kind, center, scale):
    # Non-trivial initial values: a swapped gamma/beta or an ignored initializer shows up.
    init = dict(gamma_initializer=mx.init.Constant(1.5), beta_initializer=mx.init.Constant(0.25))
    if kind == "GroupNorm":
        return gn_mx.GroupNorm(num_groups=G, center=center, scale=scale, **init)
    return gn_mx.DecorrelatedBatchNorm(num_groups=G, center=center, scale=scale, momentum=1.0,
                                       **init)


def _xhat(kind, x):
    if kind == "GroupNorm":
        return group_norm_ref(x, np.ones(C), np.zeros(C), G, 1e-5)[0]
    return dbn_ref(x, G, 1e-5)[0]


@pytest.mark.parametrize("kind", ["GroupNorm", "DecorrelatedBatchNorm"])
@pytest.mark.parametrize("center,scale", FLAGS, ids=lambda f: str(f))
@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_center_and_scale_each_alone(kind, center, scale, hybridize):
    blk = _block(kind, center, scale)
    blk.initialize(ctx=CPU)
    if hybridize:
        blk.hybridize()
    assert blk.gamma.grad_req == ("write" if scale else "null")
    assert blk.beta.grad_req == ("write" if center else "null")
    x = np.random.randn(8, C, 5) + 0.5
    w = np.random.randn(*x.shape)  # loss = sum(y * w): dbeta = sum w, dgamma = sum w * xhat
    trainer = gluon.Trainer(blk.collect_params(), "sgd", {"learning_rate": 0.1})
    xs = mx.nd.array(x)
    xs.attach_grad()  # something to differentiate when both parameters are fixed
    with autograd.record():
        loss = (blk(xs) * mx.nd.array(w)).sum()
    loss.backward()
    trainer.step(1)
    gamma, beta = blk.gamma.data().asnumpy(), blk.beta.data().asnumpy()
    red = (0, 2)
    want_gamma = 1.5 - 0.1 * (w * _xhat(kind, x)).sum(axis=red) if scale else np.full(C, 1.5)
    want_beta = 0.25 - 0.1 * w.sum(axis=red) if center else np.full(C, 0.25)
    np.testing.assert_allclose(gamma, want_gamma, rtol=1e-4, atol=1e-4, err_msg="gamma")
    np.testing.assert_allclose(beta, want_beta, rtol=1e-4, atol=1e-4, err_msg="beta")
    # The output applies gamma and beta, learned or fixed. (DBN predicts with its running
    # statistics, which momentum=1 keeps at mean 0 and projection I: xhat = x.)
    y = blk(mx.nd.array(x)).asnumpy()
    xhat = _xhat(kind, x) if kind == "GroupNorm" else x
    np.testing.assert_allclose(y, xhat * gamma.reshape(1, C, 1) + beta.reshape(1, C, 1),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["GroupNorm", "DecorrelatedBatchNorm"])
@pytest.mark.parametrize("center,scale", FLAGS[1:3], ids=lambda f: str(f))
def test_fixed_parameter_gets_no_gradient_buffer(kind, center, scale):
    """A switched-off parameter is not differentiable: its grad_req cannot be turned on later
    (so a Trainer can never move it), while the other one keeps learning."""
    blk = _block(kind, center, scale)
    blk.initialize(ctx=CPU)
    blk.collect_params().setattr("grad_req", "write")
    fixed, learned = (blk.beta, blk.gamma) if scale else (blk.gamma, blk.beta)
    assert fixed.grad_req == "null" and learned.grad_req == "write"
