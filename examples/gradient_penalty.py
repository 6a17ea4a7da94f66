"""A WGAN-GP gradient penalty through a GroupNorm critic, in MXNet 1.9 (docs/convert.md, "Double
backward").

The penalty lambda * (||dD/dx|| - 1)^2 needs the gradient of the critic's gradient. MXNet 1.9's
Convolution (and Activation, Pooling, BatchNorm) have no second-order gradients, so
autograd.grad(create_graph=True) cannot give it for a conv critic. What works: write the critic's
input gradient with forward ops -- the convolution's transpose (a convolution with the flipped,
channel-swapped weight) and
`_backward_gn_group_norm` called as an op (gn_mx registers its gradient, the double backward) --
then take one ordinary backward. The penalty block hybridizes.

Critic: x (N, 3, H, W) -> Conv 3x3 (8 ch) -> GroupNorm(4 groups, fused relu) -> spatial mean ->
Dense(1).  Run: python examples/gradient_penalty.py
"""
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

import gn_mx  # noqa: F401  (registers gn_group_norm and its double backward)

# The penalty does not depend on the critic's output bias b0 (a parameter it shares with the
# critic); MXNet reports that as "Parameter critic_b0 is not used by any computation", which is
# intended here.
warnings.filterwarnings("ignore", message=r"Parameter critic_b0 is not used by any computation",
                        category=UserWarning)

C_IN, C, G = 3, 8, 4


class _CriticParams(gluon.HybridBlock):
    """The critic's parameters; Critic and GradientPenalty share them (params=critic.params)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(C, C_IN, 3, 3), init=mx.init.Xavier())
            self.bias = self.params.get("bias", shape=(C,), init="zeros")
            self.gamma = self.params.get("gamma", shape=(C,), init="ones")
            self.beta = self.params.get("beta", shape=(C,), init="zeros")
            self.v = self.params.get("v", shape=(1, C), init=mx.init.Normal(0.5))
            self.b0 = self.params.get("b0", shape=(1,), init="zeros")

    def _features(self, F, x, weight, bias, gamma, beta):
        h = F.Convolution(x, weight, bias, kernel=(3, 3), pad=(1, 1), num_filter=C)
        y, mean, rstd = F.gn_group_norm(h, gamma, beta, num_groups=G, act_type="relu")
        return h, y, mean, rstd

    def _input_grad(self, F, x, weight, bias, gamma, beta, v, b0):
        """dD/dx of the critic's output D = sum_n D_n, written with forward ops."""
        h, y, mean, rstd = self._features(F, x, weight, bias, gamma, beta)
        ones = F.ones_like(y)
        dy = F.broadcast_mul(F.broadcast_div(ones, F.sum(ones, axis=(2, 3), keepdims=True)),
                             F.reshape(v, (1, -1, 1, 1)))  # d(spatial mean . v)/dy
        dh = F._internal._backward_gn_group_norm(dy, F.zeros_like(mean), F.zeros_like(rstd), h,
                                                 gamma, beta, y, mean, rstd, num_groups=G,
                                                 act_type="relu")[0]
        # the convolution's transpose (stride 1, pad 1): a convolution with the weight's in/out
        # channels swapped and its kernel flipped. (F.Deconvolution(dh, weight, ...) computes the
        # same, but with MKLDNN on, MXNet 1.9.1's Deconvolution weight gradient fails in the
        # optimizer step: "could not execute a primitive".)
        wt = F.flip(F.flip(F.swapaxes(weight, 0, 1), axis=2), axis=3)
        return F.Convolution(dh, wt, kernel=(3, 3), pad=(1, 1), num_filter=C_IN, no_bias=True)

    def input_grad(self, x):
        ctx = x.context
        return self._input_grad(mx.nd, x, **{k: p.data(ctx) for k, p in self._reg_params.items()})


class Critic(_CriticParams):
    def hybrid_forward(self, F, x, weight, bias, gamma, beta, v, b0):
        _, y, _, _ = self._features(F, x, weight, bias, gamma, beta)
        return F.FullyConnected(F.mean(y, axis=(2, 3)), v, b0, num_hidden=1).reshape((-1,))


class GradientPenalty(_CriticParams):
    """mean_n (||dD_n/dx_n|| - 1)^2 of the critic whose params it shares."""

    def hybrid_forward(self, F, x, weight, bias, gamma, beta, v, b0):
        g = self._input_grad(F, x, weight, bias, gamma, beta, v, b0)
        norm = F.sqrt(F.sum(F.square(g), axis=(1, 2, 3)))
        return F.mean(F.square(norm - 1))


def build(dtype=np.float32, seed=0, ctx=None):
    mx.random.seed(seed)
    critic = Critic(prefix="critic_")
    critic.initialize(ctx=ctx)
    critic.cast(dtype)
    penalty = GradientPenalty(prefix="critic_", params=critic.collect_params())
    return critic, penalty


def penalty_grads(penalty, critic, x):
    """{parameter name: d penalty / d parameter} (one ordinary backward)."""
    params = critic.collect_params()
    params.zero_grad()
    with autograd.record():
        p = penalty(x)
    p.backward()
    return {k: v.grad().asnumpy() for k, v in params.items()}


def main(steps=5, lam=10.0):
    rs = np.random.RandomState(0)
    critic, penalty = build()
    critic.hybridize()
    penalty.hybridize()
    trainer = gluon.Trainer(critic.collect_params(), "adam", {"learning_rate": 1e-3})
    history = []
    for step in range(steps):
        real = mx.nd.array(rs.randn(8, C_IN, 8, 8) + 1.0)
        fake = mx.nd.array(rs.randn(8, C_IN, 8, 8))
        eps = mx.nd.array(rs.rand(8, 1, 1, 1))
        interp = eps * real + (1 - eps) * fake
        with autograd.record():
            gp = penalty(interp)
            loss = critic(fake).mean() - critic(real).mean() + lam * gp
        loss.backward()
        trainer.step(1)
        print(f"step {step}: critic loss {loss.asscalar():+.4f}  gradient penalty "
              f"{gp.asscalar():.4f}")
        history.append((float(loss.asscalar()), float(gp.asscalar())))
    return history


if __name__ == "__main__":
    import argparse
    _ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _ap.add_argument("--steps", type=int, default=5)
    _ap.add_argument("--lam", type=float, default=10.0, help="gradient-penalty weight")
    _a = _ap.parse_args()
    main(steps=_a.steps, lam=_a.lam)
