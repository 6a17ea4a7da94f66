"""ONNX export of the gn_mx ops through MXNet's own exporter (``mx.onnx.export_model``).

``import gn_mx`` registers the converters below with MXNet's mx2onnx registry when ``onnx`` is
importable (MXNet imports it anyway at ``import mxnet``); nothing else is needed::

    import mxnet as mx, numpy as np, gn_mx
    net.export('model')                        # a hybridized Gluon net with gn_mx blocks
    mx.onnx.export_model('model-symbol.json', 'model-0000.params', in_shapes=[(1, 3, 32, 32)],
                         in_types=[np.float32], onnx_file_path='model.onnx', dynamic=True,
                         dynamic_input_shapes=[(None, 3, None, None)])

Opset: MXNet 1.9's ``mx.onnx.export_model`` always writes the installed onnx's newest opset (22 with
onnx 1.17), which older runtimes reject (onnxruntime 1.19, the last for Python 3.8/3.9, stops at
21) and at which MXNet's own converters emit invalid nodes (``ReduceMean`` with the pre-18 ``axes``
attribute). :func:`export_model` is the same export at a chosen opset, by default
:data:`DEFAULT_OPSET` = 17: every MXNet converter (written for 12/13) is valid there and
onnxruntime >= 1.12, TensorRT >= 8.6 and OpenVINO read it. Pass ``opset_version=`` (12 up to the
installed onnx's newest; >= 21 allows ``GroupNormalization-21``, see below) to override::

    gn_mx.onnx.export_model('model-symbol.json', 'model-0000.params', in_shapes=[(1, 3, 32, 32)],
                            in_types=[np.float32], onnx_file_path='model.onnx', opset_version=21)

Mapping (``opset`` = the opset of the export):

==================== ============================================================================
op                   ONNX
==================== ============================================================================
gn_group_norm        the exact two-pass composition Reshape (N, G, -1) -> ReduceMean -> Sub ->
                     ReduceMean of squares -> Add eps, Sqrt, Reciprocal, Mul -> Reshape ->
                     per-channel Mul / Add (default); or, with :data:`USE_GROUP_NORMALIZATION`
                     and opset >= 21, ``GroupNormalization-21`` (per-channel scale/bias, as
                     gn_mx) on an (N, C, -1) view. (GroupNormalization-18 scales per *group*: never
                     used.) The optional
                     ``act_type`` attribute ('none', 'relu', 'silu') adds Relu or x*Sigmoid(x).
                     ``axis=-1`` (channels last, (N, *spatial, C)): the same composition on an
                     (N, S, G, D) view, ReduceMean over axes (1, 3), gamma/beta broadcast along
                     the last axis: no Transpose (GroupNormalization takes channels on axis 1,
                     so it is never used for this layout).
                     ``mean`` / ``rstd`` are emitted when a later node reads them, or when no
                     node reads any output of the op (then it is a graph output). (A graph
                     output ``mean`` next to an ``out`` that a node reads is not detected: the
                     converter does not see the graph's heads.)
gn_moments           Reshape (N, G, -1) -> ReduceMean -> mean; ReduceMean of squared deviations
                     -> var (population variance), both (N, G); ``axis=-1`` as gn_group_norm's.
gn_dbn_inference     Sub running_mean -> MatMul(running_projection (G, D, D), x as (N, G, D, -1))
                     -> Reshape back; with ``affine=True`` (gamma, beta inputs) then the
                     per-channel Mul / Add of gn_channel_affine.
gn_channel_affine    per-channel Mul / Add on an (N, C, -1) view.
gn_dbn               not exported: it is the training op (``HybridBlock.export`` always writes the
                     inference graph with ``gn_dbn_inference``); a clear error says so.
gn_sync_sum          not exported, as gn_dbn (nor ``gn_dbn_whiten``, ``gn_dbn_apply``,
                     ``gn_dbn_local_sums``, ``gn_dbn_local_cov``): synchronized DBN's training
                     ops (a barrier across devices, batch statistics);
                     ``SyncDecorrelatedBatchNorm.export`` writes ``gn_dbn_inference``. A clear
                     error says so.
==================== ============================================================================

``gn_weight_standardize`` (the ``WSConv*D`` weight): Reshape (O, -1) -> ReduceMean -> Sub ->
ReduceMean of squares -> Add eps, Sqrt, Reciprocal, Mul -> Mul gain -> Reshape to the weight's
shape; ``mean`` / ``rstd`` (O,) as for gn_group_norm.

Every shape is taken at run time (Reshape with 0 / -1, Shape): batch and spatial sizes stay
dynamic, and any number of spatial dims (0-3+) works. float16 data with float32 statistics
(multi-precision) is computed in float32 and cast back, float64 stays float64.
"""
import contextlib
import functools
import threading

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from ._library import _import_mxnet

mx = _import_mxnet()

__all__ = ["export_model", "DEFAULT_OPSET", "MIN_OPSET", "USE_GROUP_NORMALIZATION",
           "KEEP_INITIALIZER_INPUTS", "CONVERTED_OPS", "ACT_TYPES"]

try:  # MXNet's exporter registry (mxnet/onnx/mx2onnx/_export_onnx.py, MXNet 1.9)
    from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph as _MXNetGraph
except ImportError as e:  # pragma: no cover - depends on the MXNet build
    raise ImportError(f"gn_mx.onnx: this MXNet has no mx2onnx exporter registry ({e})") from None
if not callable(getattr(_MXNetGraph, "register", None)):  # pragma: no cover
    raise ImportError("gn_mx.onnx: MXNet's mx2onnx exporter has no MXNetGraph.register")

#: Export gn_group_norm as ONNX GroupNormalization-21 when the export opset is >= 21 (one node,
#: which runtimes such as TensorRT fuse). Off by default: onnxruntime 1.32's GroupNormalization
#: kernel computes the variance in one pass (E[x^2] - E[x]^2), which loses the digits for data far
#: from zero (measured, fp32: max error 6e-5 for x = 10 + N(0, 1), 8e-3 for 100 + N(0, 1), 0.8 for
#: 1000 + N(0, 1), against 3e-6 / 2e-5 / 2e-4 for the default two-pass composition and 2e-6 /
#: 2e-5 / 1e-4 for gn_mx itself).
USE_GROUP_NORMALIZATION = False

#: The opset :func:`export_model` writes unless told otherwise (see the module docstring).
DEFAULT_OPSET = 17
#: The oldest opset MXNet 1.9's converters are registered for.
MIN_OPSET = 12
_opset_lock = threading.Lock()


@contextlib.contextmanager
def _export_opset(opset):
    """Make MXNet's exporter see `opset` as onnx's newest: MXNet 1.9's export_model reads
    ``onnx.defs.onnx_opset_version()`` at each call (as does onnx.helper.make_model, which stamps the
    model) and has no argument for it, and it checks the graph with onnx.checker's default
    context, whose opset onnx fixed at import."""
    from onnx import checker
    with _opset_lock:
        newest, ctx_opsets = onnx.defs.onnx_opset_version, checker.DEFAULT_CONTEXT.opset_imports
        onnx.defs.onnx_opset_version = lambda: opset
        checker.DEFAULT_CONTEXT.opset_imports = {**ctx_opsets, "": opset}
        try:
            yield
        finally:
            onnx.defs.onnx_opset_version = newest
            checker.DEFAULT_CONTEXT.opset_imports = ctx_opsets


def export_model(sym, params, *args, opset_version=None, **kwargs):
    """``mx.onnx.export_model(sym, params, ...)`` writing a chosen ONNX opset.

    Parameters
    ----------
    sym : str or Symbol
        The exported model's ``-symbol.json`` file (or the symbol), as for MXNet's exporter.
    params : str or dict
        Its ``-NNNN.params`` file (or the parameter dict).
    *args
        Passed to ``mx.onnx.export_model`` (``in_shapes``, ``in_types``, ``onnx_file_path``, ...).
    opset_version : int, optional
        The opset to write: :data:`DEFAULT_OPSET` (17) by default; from :data:`MIN_OPSET` (12)
        up to the installed onnx's newest.
    **kwargs
        Passed to ``mx.onnx.export_model`` (``in_shapes``, ``in_types``, ``onnx_file_path``,
        ``dynamic``, ``dynamic_input_shapes``, ...).

    Returns
    -------
    str
        The path of the .onnx file written (MXNet's return value).

    Raises
    ------
    ValueError
        ``opset_version`` out of range or not an int.
    NotImplementedError
        The graph holds ``gn_dbn`` (a training graph; export the inference graph that
        ``HybridBlock.export`` writes).

    Examples
    --------
    >>> import os, tempfile
    >>> net = mx.gluon.nn.HybridSequential()
    >>> net.add(mx.gluon.nn.Conv2D(4, 3, in_channels=3), gn_mx.GroupNorm(num_groups=2))
    >>> net.initialize()
    >>> net.hybridize()
    >>> _ = net(mx.nd.ones((1, 3, 8, 8)))
    >>> d = tempfile.mkdtemp()
    >>> net.export(os.path.join(d, 'net'))
    >>> path = gn_mx.onnx.export_model(os.path.join(d, 'net-symbol.json'),
    ...                                os.path.join(d, 'net-0000.params'),
    ...                                in_shapes=[(1, 3, 8, 8)], in_types=[np.float32],
    ...                                onnx_file_path=os.path.join(d, 'net.onnx'))
    >>> import onnx
    >>> onnx.load(path).opset_import[0].version
    17
    """
    newest = onnx.defs.onnx_opset_version()
    opset = DEFAULT_OPSET if opset_version is None else opset_version
    if isinstance(opset, bool) or not isinstance(opset, (int, np.integer)) or not (
            MIN_OPSET <= opset <= newest):
        raise ValueError(f"gn_mx.onnx.export_model: opset_version must be an int from {MIN_OPSET} "
                         f"(MXNet's converters) to {newest} (onnx {onnx.__version__}'s newest), "
                         f"got {opset_version!r}")
    with _export_opset(min(int(opset), newest)):
        return mx.onnx.export_model(sym, params, *args, **kwargs)


#: MXNet 1.9's exporter lists every initializer (the parameters) among the graph's inputs as well.
#: onnxruntime then prints one warning per parameter ("Initializer ... appears in graph inputs and
#: will not be treated as constant value/weight"), which a user cannot act on, and skips constant
#: folding of them. gn_mx's import makes exports list only the real inputs (data); set this to True
#: to keep MXNet's form (parameters overridable as inputs).
KEEP_INITIALIZER_INPUTS = False


def _drop_initializer_inputs(graph):
    """`graph` (an onnx GraphProto) without the inputs that are also initializers (ONNX IR >= 4
    needs no input entry for an initializer)."""
    names = {t.name for t in graph.initializer}
    keep = [i for i in graph.input if i.name not in names]
    if len(keep) != len(graph.input):
        del graph.input[:]
        graph.input.extend(keep)
    return graph


def _wrap_graph_proto():
    """Post-process every graph MXNet's exporter creates (``MXNetGraph.create_onnx_graph_proto``,
    which both ``mx.onnx.export_model`` and :func:`export_model` call); once per process."""
    orig = _MXNetGraph.create_onnx_graph_proto
    if getattr(orig, "_gnmx_wrapped", False):
        return

    @functools.wraps(orig)
    def create_onnx_graph_proto(self, *args, **kwargs):
        graph = orig(self, *args, **kwargs)
        return graph if KEEP_INITIALIZER_INPUTS else _drop_initializer_inputs(graph)

    create_onnx_graph_proto._gnmx_wrapped = True
    _MXNetGraph.create_onnx_graph_proto = create_onnx_graph_proto


_wrap_graph_proto()

#: Every op of the library (``_library.OPS``) has a converter; the training ops' refuse clearly.
CONVERTED_OPS = ("gn_group_norm", "gn_moments", "gn_dbn_inference", "gn_channel_affine", "gn_dbn",
                 "gn_weight_standardize", "gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply",
                 "gn_dbn_local_sums", "gn_dbn_local_cov")
ACT_TYPES = ("none", "relu", "silu")


class _Builder:
    """Collects the ONNX nodes of one MXNet node; intermediate names are prefixed with its name."""

    def __init__(self, node, kwargs):
        self.name = node["name"]
        self.attrs = node.get("attrs", {}) or {}
        self.kwargs = kwargs
        self.opset = int(kwargs.get("opset_version") or onnx.defs.onnx_opset_version())
        lookup = kwargs["outputs_lookup"]
        self.inputs = [lookup[i][j].name for i, j, *_ in node["inputs"]]
        self.in_dtypes = [np.dtype(lookup[i][j].dtype) for i, j, *_ in node["inputs"]]
        self.nodes = []
        self._count = 0

    def tmp(self, what):
        self._count += 1
        return f"{self.name}__gn{self._count}_{what}"

    def const(self, what, value):
        name = self.tmp(what)
        self.kwargs["initializer"].append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type, inputs, out=None, **attrs):
        out = out or self.tmp(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def reduce_mean(self, x, axis, out=None):
        axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
        if self.opset >= 18:  # axes became an input in ReduceMean-18
            return self.op("ReduceMean", [x, self.const("axes", np.array(axes, np.int64))], out,
                           keepdims=1)
        return self.op("ReduceMean", [x], out, axes=axes, keepdims=1)

    def cast(self, x, from_dtype, to_dtype, out=None):
        if np.dtype(from_dtype) == np.dtype(to_dtype):
            return self.op("Identity", [x], out) if out else x
        to = helper.np_dtype_to_tensor_dtype(np.dtype(to_dtype))
        return self.op("Cast", [x], out, to=to)

    def reshape(self, x, shape, out=None):
        if not isinstance(shape, str):
            shape = self.const("shape", np.array(shape, np.int64))
        return self.op("Reshape", [x, shape], out)

    def attr_int(self, key, default):
        return int(str(self.attrs.get(key, default)).strip())

    def attr_float(self, key, default):
        return float(str(self.attrs.get(key, default)).strip())

    def consumed(self, index):
        """Whether output `index` of this node may be used: read by a later node, or the node's
        outputs are read by nobody (then it is a graph output, with any of its outputs)."""
        graph, idx = self.kwargs.get("mx_graph"), self.kwargs.get("idx")
        if graph is None or idx is None:
            return True
        used = {j for n in graph[idx + 1:] for i, j, *_ in n.get("inputs", []) if i == idx}
        return not used or index in used


def _compute_dtype(dtype):
    """Accumulation dtype of gn_mx: float64 for float64 data, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _register(op_name):
    def wrap(fn):
        _MXNetGraph.register(op_name, opset_version=12)(fn)  # found for every opset >= 12
        return fn
    return wrap


def _group_stats(b, x, G):
    """(mean, centred x, var) of x viewed as (N, G, M); mean and var are (N, G, 1)."""
    xg = b.reshape(x, [0, G, -1])
    mean = b.reduce_mean(xg, 2)
    d = b.op("Sub", [xg, mean])
    var = b.reduce_mean(b.op("Mul", [d, d]), 2)
    return mean, d, var


def _channels_last(b):
    """Whether the node's ``axis`` attribute (absent: 1) puts the channels on the last axis. The
    op accepts only an axis that resolves to 1 or to ndim - 1 (src/operator/mx/validate.h), so
    without knowing the rank: -1 and any axis > 1 are the last axis, any other (1, or -ndim + 1) is
    axis 1."""
    axis = b.attr_int("axis", 1)
    return axis == -1 or axis > 1


def _group_stats_last(b, x, G):
    """Channels-last (N, *spatial, C) data viewed as (N, S, G, D) (no transpose: a group is D
    contiguous values at each of S positions): (mean, centred x, var), mean and var (N, 1, G, 1).
    D = C / G is taken from the input's shape at run time."""
    c = b.op("Gather", [b.op("Shape", [x]), b.const("last", np.array([-1], np.int64))], axis=0)
    d = b.op("Div", [c, b.const("g", np.array([G], np.int64))])
    view = b.op("Concat", [b.const("nsg", np.array([0, -1, G], np.int64)), d], axis=0)
    xg = b.reshape(x, view)
    mean = b.reduce_mean(xg, [1, 3])
    dev = b.op("Sub", [xg, mean])
    var = b.reduce_mean(b.op("Mul", [dev, dev]), [1, 3])
    return mean, dev, var


def _rstd(b, var, eps, dtype):
    return b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.const("eps",
                                                                        np.array(eps, dtype))])])])


def _activation(b, y, act):
    """gn_group_norm's optional fused activation (attribute act_type, default 'none')."""
    if act == "relu":
        return b.op("Relu", [y])
    if act == "silu":
        return b.op("Mul", [y, b.op("Sigmoid", [y])])
    return y


def _group_norm_outputs(b, y, mean, rstd, want_stats, xdt, cdt):
    """gn_group_norm's outputs: y in the input dtype, then (N, G) mean and rstd when consumed."""
    b.cast(y, cdt, xdt, b.name + "0")
    if not want_stats:
        return b.nodes, (xdt,)
    b.reshape(mean, [0, -1], b.name + "1")
    b.reshape(rstd, [0, -1], b.name + "2")
    return b.nodes, (xdt, cdt, cdt)


@_register("gn_group_norm")
def convert_group_norm(node, **kwargs):
    """MXNet exporter converter of ``gn_group_norm`` (see the module docstring's table)."""
    b = _Builder(node, kwargs)
    G = b.attr_int("num_groups", 1)
    eps = b.attr_float("eps", 1e-5)
    act = str(b.attrs.get("act_type", "none")).strip().strip("'\"").lower()
    if act not in ACT_TYPES:
        raise NotImplementedError(f"gn_mx.onnx: gn_group_norm act_type={act!r} has no ONNX "
                                  f"mapping (known: {', '.join(ACT_TYPES)})")
    x, gamma, beta = b.inputs
    xdt, gdt, bdt = b.in_dtypes
    cdt = _compute_dtype(xdt)
    xc = b.cast(x, xdt, cdt)
    want_stats = b.consumed(1) or b.consumed(2)
    if _channels_last(b):
        # (N, S, G, D) view; gamma/beta (C,) broadcast along the last axis of (N, S, C)
        mean, d, var = _group_stats_last(b, xc, G)
        rstd = _rstd(b, var, eps, cdt)
        xhat = b.reshape(b.op("Mul", [d, rstd]), b.op("Shape", [x]))  # (S, G, D) = (*spatial, C)
        y = _activation(b, b.op("Add", [b.op("Mul", [xhat, b.cast(gamma, gdt, cdt)]),
                                        b.cast(beta, bdt, cdt)]), act)
        return _group_norm_outputs(b, y, mean, rstd, want_stats, xdt, cdt)
    x3 = b.reshape(xc, [0, 0, -1])  # (N, C, S): rank-agnostic, 0 spatial dims included
    if USE_GROUP_NORMALIZATION and b.opset >= 21:
        # per-channel scale/bias (GroupNormalization-21), on the (N, C, S) view
        y3 = b.op("GroupNormalization", [x3, b.cast(gamma, gdt, cdt), b.cast(beta, bdt, cdt)],
                  num_groups=G, epsilon=eps)
        mean = rstd = None
        if want_stats:
            mean, _, var = _group_stats(b, x3, G)
            rstd = _rstd(b, var, eps, cdt)
    else:
        mean, d, var = _group_stats(b, x3, G)
        rstd = _rstd(b, var, eps, cdt)
        xhat = b.reshape(b.op("Mul", [d, rstd]), b.op("Shape", [x3]))
        g2 = b.reshape(b.cast(gamma, gdt, cdt), [-1, 1])
        b2 = b.reshape(b.cast(beta, bdt, cdt), [-1, 1])
        y3 = b.op("Add", [b.op("Mul", [xhat, g2]), b2])
    y = _activation(b, b.reshape(y3, b.op("Shape", [x])), act)
    return _group_norm_outputs(b, y, mean, rstd, want_stats, xdt, cdt)


@_register("gn_moments")
def convert_moments(node, **kwargs):
    """MXNet exporter converter of ``gn_moments``."""
    b = _Builder(node, kwargs)
    G = b.attr_int("num_groups", 1)
    (x,), (xdt,) = b.inputs, b.in_dtypes
    cdt = _compute_dtype(xdt)
    stats = _group_stats_last if _channels_last(b) else _group_stats
    mean, _, var = stats(b, b.cast(x, xdt, cdt), G)
    b.reshape(mean, [0, -1], b.name + "0")
    b.reshape(var, [0, -1], b.name + "1")
    return b.nodes, (cdt, cdt)


def _affine_attr(b):
    """gn_dbn / gn_dbn_inference's ``affine`` attribute (absent in graphs exported before it)."""
    return str(b.attrs.get("affine", "False")).strip().lower() in ("true", "1")


def _per_channel_affine(b, x3, gamma, beta, gdt, bdt, cdt):
    """gamma[c] * x3 + beta[c] on an (N, C, S) view in dtype cdt."""
    return b.op("Add", [b.op("Mul", [x3, b.reshape(b.cast(gamma, gdt, cdt), [-1, 1])]),
                        b.reshape(b.cast(beta, bdt, cdt), [-1, 1])])


@_register("gn_dbn_inference")
def convert_dbn_inference(node, **kwargs):
    """MXNet exporter converter of ``gn_dbn_inference`` (with or without the fused affine)."""
    b = _Builder(node, kwargs)
    G = b.attr_int("num_groups", 1)
    if _affine_attr(b):  # inputs data, gamma, beta, running_mean, running_projection
        x, gamma, beta, mean, proj = b.inputs
        xdt, gdt, bdt, mdt, pdt = b.in_dtypes
    else:
        x, mean, proj = b.inputs
        xdt, mdt, pdt = b.in_dtypes
        gamma = None
    cdt = _compute_dtype(xdt)
    x3 = b.reshape(b.cast(x, xdt, cdt), [0, 0, -1])                       # (N, C, S)
    xc = b.op("Sub", [x3, b.reshape(b.cast(mean, mdt, cdt), [-1, 1])])
    p = b.cast(proj, pdt, cdt)                                            # (G, D, D)
    d = b.op("Gather", [b.op("Shape", [p]), b.const("dim", np.array([2], np.int64))], axis=0)
    view = b.op("Concat", [b.const("ng", np.array([0, G], np.int64)), d,
                           b.const("s", np.array([-1], np.int64))], axis=0)
    yg = b.op("MatMul", [p, b.reshape(xc, view)])                         # (N, G, D, S)
    if gamma is not None:
        yg = _per_channel_affine(b, b.reshape(yg, b.op("Shape", [x3])), gamma, beta, gdt, bdt, cdt)
    return _single_output(b, yg, x, cdt, xdt)


def _single_output(b, y, x, cdt, xdt):
    """A one-output converter's end: ``y`` (compute dtype ``cdt``) in ``x``'s shape, cast back to
    ``xdt`` as the node's output; the exporter's (nodes, output dtypes)."""
    y = b.reshape(y, b.op("Shape", [x]))
    b.cast(y, cdt, xdt, b.name)
    return b.nodes, (xdt,)


@_register("gn_channel_affine")
def convert_channel_affine(node, **kwargs):
    """MXNet exporter converter of ``gn_channel_affine``."""
    b = _Builder(node, kwargs)
    x, gamma, beta = b.inputs
    xdt, gdt, bdt = b.in_dtypes
    cdt = _compute_dtype(xdt) if gdt != xdt else xdt
    x3 = b.reshape(b.cast(x, xdt, cdt), [0, 0, -1])
    y3 = _per_channel_affine(b, x3, gamma, beta, gdt, bdt, cdt)
    return _single_output(b, y3, x, cdt, xdt)


@_register("gn_weight_standardize")
def convert_weight_standardize(node, **kwargs):
    """MXNet exporter converter of ``gn_weight_standardize`` (Weight Standardization)."""
    b = _Builder(node, kwargs)
    eps = b.attr_float("eps", 1e-5)
    w, gain = b.inputs
    wdt, gdt = b.in_dtypes
    cdt = _compute_dtype(wdt)
    w2 = b.reshape(b.cast(w, wdt, cdt), [0, -1])  # (O, F): one row per output channel
    mean = b.reduce_mean(w2, 1)
    d = b.op("Sub", [w2, mean])
    rstd = _rstd(b, b.reduce_mean(b.op("Mul", [d, d]), 1), eps, cdt)
    y2 = b.op("Mul", [b.op("Mul", [d, rstd]), b.reshape(b.cast(gain, gdt, cdt), [-1, 1])])
    b.cast(b.reshape(y2, b.op("Shape", [w])), cdt, wdt, b.name + "0")
    if not (b.consumed(1) or b.consumed(2)):
        return b.nodes, (wdt,)
    b.reshape(mean, [-1], b.name + "1")
    b.reshape(rstd, [-1], b.name + "2")
    return b.nodes, (wdt, cdt, cdt)


@_register("gn_dbn")
def convert_dbn_training(node, **kwargs):
    """``gn_dbn`` is not exported: raises NotImplementedError naming the inference graph."""
    raise NotImplementedError(
        f"gn_mx.onnx: {node['name']} is gn_dbn, DecorrelatedBatchNorm's training op (batch "
        "statistics, in-place running-statistics update); ONNX export needs the inference graph "
        "(gn_dbn_inference). HybridBlock.export() always writes that graph: export the symbol "
        "and params it saves.")


def _refuse_sync(node, **kwargs):
    """The synchronized-DBN ops are not exported: NotImplementedError naming the inference graph."""
    raise NotImplementedError(
        f"gn_mx.onnx: {node['name']} is {node['op']}, a step of SyncDecorrelatedBatchNorm's "
        "training (statistics across devices); ONNX export needs the inference graph "
        "(gn_dbn_inference). SyncDecorrelatedBatchNorm.export() always writes that graph: export "
        "the symbol and params it saves.")


for _op in ("gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply", "gn_dbn_local_sums",
            "gn_dbn_local_cov"):
    _register(_op)(_refuse_sync)
