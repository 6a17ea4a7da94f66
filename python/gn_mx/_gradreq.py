"""grad_req-keyed graphs for hybridized blocks whose gn_mx ops route parameters through `identity`.

MXNet's lib_api passes library ops no `req`, so their backward always overwrites the gradient
buffer it is given; a parameter with grad_req='add' must therefore reach a library op through a
built-in `identity` (which honours 'add'). That copy is only needed for 'add', so the blocks decide
per parameter when the graph is traced (`nn.accumulating_params`). MXNet does not re-trace a
hybridized block when a parameter's grad_req changes (e.g. ``collect_params().setattr('grad_req',
'add')`` after the first call), so without help the cached graph would keep the old decision and
silently overwrite instead of accumulating.

This module makes the decision part of the trace's key, for every HybridBlock (parents included):
  * a symbolic trace that made such a decision calls ``note_traced(params)``;
  * the ``_get_graph`` of the hybridized block that owns the trace records ``(param, is_add)``;
  * its ``_call_cached_op`` re-checks those parameters (a few attribute reads) and drops the cache
    (re-trace on this call) when any of them switched into or out of 'add'.
Blocks without such parameters pay one dict lookup per call.
"""
import threading

from mxnet.gluon import block as _block

_tls = threading.local()
_KEY = "_gnmx_grad_req"


def is_add(param):
    return param is not None and param.grad_req == "add"


def note_traced(params):
    """Called by a symbolic trace that chose identity-or-not from these Parameters' grad_req."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.extend(p for p in params if p is not None)


def _stale(rec):
    for p, was_add in rec:
        if (p.grad_req == "add") != was_add:
            return True
    return False


def _install():
    HB = _block.HybridBlock
    if getattr(HB, "_gnmx_grad_req_installed", False):
        return
    orig_get_graph = HB._get_graph
    orig_call_cached_op = HB._call_cached_op

    def _get_graph(self, *args):
        if self._cached_graph:
            return orig_get_graph(self, *args)
        outer = getattr(_tls, "rec", None)
        _tls.rec = []
        try:
            res = orig_get_graph(self, *args)
            rec = _tls.rec
        finally:
            _tls.rec = outer
        if outer is not None:
            outer.extend(rec)
        if rec:
            self.__dict__[_KEY] = [(p, p.grad_req == "add") for p in rec]
        else:
            self.__dict__.pop(_KEY, None)
        return res

    def _call_cached_op(self, *args):
        rec = self.__dict__.get(_KEY)
        if rec is not None and _stale(rec):
            self._clear_cached_op()  # re-traced (and re-keyed) by this call
        return orig_call_cached_op(self, *args)

    HB._get_graph = _get_graph
    HB._call_cached_op = _call_cached_op
    HB._gnmx_grad_req_installed = True


_install()
