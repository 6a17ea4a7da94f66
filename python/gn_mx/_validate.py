"""Argument checks shared by the Gluon blocks (nn.py), the Symbol helpers (sym.py) and the functional
wrappers (ops.py): one home for each rule and its message.

Every check raises ValueError naming the caller (``who``: a block class or function name), the
argument, the rule and the value received. The ops re-check what reaches them (shapes, dtypes,
attributes; src/operator/mx) with their own messages; these checks catch bad constructor arguments
before any graph exists.
"""
import numbers

#: activation argument -> the ops' ``act_type`` attribute ('swish' is a synonym of 'silu').
_ACTS = {None: "none", "none": "none", "relu": "relu", "silu": "silu", "swish": "silu"}
#: DecorrelatedBatchNorm's number of groups when neither num_groups nor group_size is given.
DBN_DEFAULT_GROUPS = 16
#: The channel-axis rule of data of a known rank, worded once: channel_axis's message and the ops'
#: (src/operator/mx/validate.h data_groups, checked against this text by
#: tests/test_channels_last.py::test_axis_message_has_one_wording). ``last`` = ndim - 1.
AXIS_RULE = ("axis must be 1 (channels first, (N, C, *spatial)) or the last axis (-1 or {last}, "
             "channels last, (N, *spatial, C))")


def _positive_int(x):
    return not isinstance(x, bool) and isinstance(x, numbers.Integral) and x > 0


def act_type(activation):
    """The op's ``act_type`` for an ``activation`` argument (None, 'relu', 'silu' or 'swish')."""
    try:
        return _ACTS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be None, 'relu' or 'silu' ('swish' = 'silu'), "
                         f"got {activation!r}") from None


def axis_attr(who, axis):
    """The ops' optional ``axis`` attribute for a channel-axis argument: ``{}`` for the default 1
    (channels first; the attribute is left out, so graphs stay as before), else ``{"axis": axis}``.
    The axis is 1 or the data's last axis (-1, or ndim - 1: channels last); which one the data's
    rank allows is checked at the call (``channel_axis``) and by the op. 0 (the batch axis) and
    non-integers are refused here."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or axis == 0:
        raise ValueError(f"{who}: axis must be 1 (channels first, (N, C, *spatial)) or -1 "
                         f"(channels last, (N, *spatial, C)); got {axis!r}")
    return {} if axis == 1 else {"axis": int(axis)}


def channel_axis(who, axis, shape):
    """The position of the channel axis ``axis`` (1 or the last axis, counted from the end when
    negative) in an input of ``shape`` (at least 2 dims); ValueError for any other axis."""
    nd = len(shape)
    a = axis + nd if axis < 0 else axis
    if a != 1 and a != nd - 1:
        raise ValueError(f"{who}: {AXIS_RULE.format(last=nd - 1)}; got axis={axis} "
                         f"for input shape {tuple(shape)}")
    return a


def check_groups(who, num_groups, epsilon, in_channels):
    """num_groups a positive integer, epsilon finite and >= 0, in_channels an integer >= 0
    (0 = inferred later) divisible by num_groups."""
    if not _positive_int(num_groups):
        raise ValueError(f"{who}: num_groups must be a positive integer, got {num_groups!r}")
    if not isinstance(epsilon, numbers.Real) or not epsilon >= 0 or epsilon == float("inf"):
        raise ValueError(f"{who}: epsilon must be a finite number >= 0, got {epsilon!r}")
    if isinstance(in_channels, bool) or not isinstance(in_channels, numbers.Integral) or in_channels < 0:
        raise ValueError(f"{who}: in_channels must be an integer >= 0 (0 = infer), got {in_channels!r}")
    if in_channels and in_channels % num_groups:
        raise ValueError(f"{who}: in_channels ({in_channels}) must be divisible by num_groups "
                         f"({num_groups})")


def check_group_size(who, channels, group_size):
    """channels (when known, i.e. > 0) divisible by group_size."""
    if channels and channels % group_size:
        raise ValueError(f"{who}: in_channels ({channels}) must be divisible by group_size "
                         f"({group_size})")


def dbn_grouping(num_groups, group_size, epsilon, in_channels, who="DecorrelatedBatchNorm"):
    """DecorrelatedBatchNorm's grouping: at most one of num_groups / group_size (neither: 16 groups).
    Returns (num_groups, or None with group_size and unknown in_channels; group_size or None)."""
    if num_groups is not None and group_size is not None:
        raise ValueError(f"{who}: give num_groups or group_size, not both "
                         f"(got num_groups={num_groups!r}, group_size={group_size!r})")
    if group_size is None:
        num_groups = DBN_DEFAULT_GROUPS if num_groups is None else num_groups
        check_groups(who, num_groups, epsilon, in_channels)
        return int(num_groups), None
    if not _positive_int(group_size):
        raise ValueError(f"{who}: group_size must be a positive integer, got {group_size!r}")
    check_groups(who, 1, epsilon, in_channels)
    check_group_size(who, in_channels, group_size)
    return (in_channels // group_size if in_channels else None), int(group_size)


def check_dbn_numbers(who, epsilon, momentum, eps_name="epsilon"):
    """DBN's epsilon > 0 (the covariance must stay invertible) and momentum in [0, 1].
    ``eps_name``: the caller's name for epsilon (the Symbol helpers call it ``eps``)."""
    if not epsilon > 0:
        raise ValueError(f"{who}: {eps_name} must be > 0, got {epsilon!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1:
        raise ValueError(f"{who}: momentum must be in [0, 1], got {momentum!r}")


# IterNorm's largest T: the Newton iteration amplifies rounding errors from ~12 iterations on
# ill-conditioned covariances (docs/dbn.md); the op checks the same limit (dbn.h kDbnMaxIterations).
MAX_ITERNORM_ITERATIONS = 10


def check_whitening(who, whitening, iterations):
    """DBN's training whitening: 'zca' or 'iternorm' with an integer T in [1, 10]."""
    if whitening not in ("zca", "iternorm"):
        raise ValueError(f"{who}: whitening must be 'zca' or 'iternorm', got {whitening!r}")
    if (isinstance(iterations, bool) or not isinstance(iterations, numbers.Integral)
            or not 1 <= iterations <= MAX_ITERNORM_ITERATIONS):
        raise ValueError(f"{who}: iterations must be an integer in [1, {MAX_ITERNORM_ITERATIONS}], "
                         f"got {iterations!r}")


#: DecorrelatedBatchNorm's largest group size on the CPU (the op's own limit, kernels/dbn.h
#: kDbnMaxGroupSizeCpu; any device fails above it, CUDA's smaller one is checked by the op).
DBN_MAX_GROUP_SIZE_CPU = 4096


def check_channels(who, C, shape, num_groups=None, group_size=None, channels=0,
                   max_group_size=None):
    """The channel rules a block can check on its input before any op runs, so the message names
    the layer, also under deferred initialization (where Gluon would report the op's error as
    "Deferred initialization failed because shape cannot be inferred"): C equal to the layer's
    channels when they are known (``channels`` > 0), C divisible by ``num_groups`` or
    ``group_size``, the group size at most ``max_group_size``. ``shape``: the input's shape for the
    message (None when only C is known, in a symbolic trace)."""
    of = f" (input shape {tuple(shape)})" if shape is not None else ""
    if channels and C != channels:
        raise ValueError(f"{who}: the input has C={C} channels{of}, but the layer has "
                         f"{channels} (in_channels, or the first input's C)")
    if group_size is not None:
        check_group_size(who, C, group_size)
        D = group_size
    else:
        if C % num_groups:
            divisors = ", ".join(str(d) for d in range(1, C + 1) if C % d == 0)
            raise ValueError(f"{who}: channels (C={C}) must be divisible by num_groups "
                             f"({num_groups}){of}; choose num_groups among the divisors of C: "
                             f"{divisors}")
        D = C // num_groups
    if max_group_size is not None and D > max_group_size:
        raise ValueError(f"{who}: group size C/num_groups = {D} exceeds the limit "
                         f"{max_group_size}{of}; use more groups (or a smaller group_size)")


def check_data_shape(who, shape, axis=1, **rules):
    """An input of known ``shape``: at least 2 dims (N, C, *spatial), or (N, *spatial, C) with
    ``axis`` the last axis (``channel_axis``), then ``check_channels``."""
    if len(shape) < 2:
        raise ValueError(f"{who}: input must have at least 2 dims (N, C, *spatial); got shape "
                         f"{tuple(shape)}")
    check_channels(who, shape[channel_axis(who, axis, shape)], shape, **rules)


def check_float_dtype(who, dtype):
    """float16, float32 or float64 data (the ops' rule, reported with the layer's name)."""
    import numpy as np
    if np.dtype(dtype).name not in ("float16", "float32", "float64"):
        raise ValueError(f"{who}: input dtype must be float16, float32 or float64; got "
                         f"{np.dtype(dtype).name} (cast the input, e.g. x.astype('float32'))")


def check_nonempty(who, x):
    """A clear error for an empty batch (Gluon's deferred init would fail with an AssertionError).
    Symbols (no shape) pass."""
    shape = getattr(x, "shape", None)
    if shape is not None and 0 in shape:
        raise ValueError(f"{who}: input of shape {shape} is empty; gn_mx blocks "
                         f"need at least one sample and one element per channel")
