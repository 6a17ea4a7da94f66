"""Walking and editing a Gluon block tree: the one home of the mechanics that ``gn_mx.convert``,
``gn_mx.replace_norm`` and ``gn_mx.ws.standardize_convs`` share.

The rule for a layer at the root (the block passed in is itself a layer to replace): it is wrapped
in a holder so that the walk sees it as a child, replaced like any other, and the function that
returns the edited block returns the new layer (``root_holder`` / ``unwrap``). A function whose
result is not the block (``standardize_convs`` returns the swapped paths) cannot hand back a new
root, so it refuses one with a ValueError (``refuse_root``).
"""
from mxnet import gluon

from . import _compat


def param_state(p):
    """'init' (values exist), 'deferred' (initialize() called, shape unknown) or 'none'."""
    if p._data is not None:
        return "init"
    return "deferred" if p._deferred_init else "none"


def walk(block, path=""):
    """Yield ``(parent, key, child, path)`` for every descendant of ``block``, depth first, in
    registration order (``path``: the dotted child keys from ``block``, e.g. ``'features.0'``)."""
    for key, child in list(block._children.items()):
        cpath = f"{path}.{key}" if path else key
        yield block, key, child, cpath
        yield from walk(child, cpath)


def blocks(block):
    """``block`` and all its descendants."""
    return [block] + [c for _, _, c, _ in walk(block)]


def replace_child(parent, key, old, new):
    """Put ``new`` in ``old``'s slot ``key`` of ``parent``, and in every attribute of ``parent``
    that held ``old`` (children registered by attribute assignment)."""
    parent._children[key] = new
    for k, v in list(vars(parent).items()):
        if v is old:
            object.__setattr__(parent, k, new)


def clear_hybrid_caches(block):
    """Drop the traced graphs of ``block`` and its HybridBlock descendants (they hold the old
    layers' graphs); the next call traces again."""
    for b in blocks(block):
        if isinstance(b, gluon.HybridBlock):
            _compat.clear_cached_op(b)


def root_holder(block, is_target):
    """The root to walk: ``block`` itself, or, when ``is_target(block)`` (the block is itself a
    layer to replace), a holder whose only child ``'0'`` is ``block``."""
    if not is_target(block):
        return block
    holder = gluon.nn.HybridSequential(prefix="")
    holder._children["0"] = block
    return holder


def unwrap(root, block):
    """What the edit of ``block`` returns: the holder's (new) child when ``root`` is a holder made
    by :func:`root_holder`, else ``block``."""
    return root._children["0"] if root is not block else block


def refuse_root(who, block, is_target, what):
    """The ValueError of a function that cannot return a new root, when ``block`` is itself a
    target."""
    if is_target(block):
        raise ValueError(f"{who}: the root block is itself a plain {type(block).__name__}, which "
                         f"cannot be replaced in place; wrap it in a container or build {what} "
                         "directly")
