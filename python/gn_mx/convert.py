"""Command line: ``python -m gn_mx.convert in-prefix epoch out-prefix [--fuse-activation]``.

Rewrites an exported model's GroupNorm/InstanceNorm nodes into gn_mx's gn_group_norm (see
docs/convert.md). This module holds the command line (``main``); the functions live in
gn_mx._convert and are ``gn_mx.convert`` /
``gn_mx.convert_symbol``; this module is callable as ``gn_mx.convert`` too, so an explicit
``import gn_mx.convert`` (which rebinds the package attribute to this module) changes nothing.
"""
import argparse
import sys
import types

import mxnet as mx

from ._convert import ConversionReport, convert, convert_symbol


__all__ = ["convert", "convert_symbol", "ConversionReport", "main"]


def _parse_shape(text):
    name, _, dims = text.partition(":")
    if not dims:
        raise argparse.ArgumentTypeError(f"--data-shape wants name:d0,d1,...; got {text!r}")
    return name, tuple(int(d) for d in dims.split(","))


def main(argv=None):
    """``python -m gn_mx.convert in-prefix epoch out-prefix [--fuse-activation] [--data-shape ...]``.

    Parameters
    ----------
    argv : list of str, optional
        The command line arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 (the exit status); argparse exits with 2 on bad arguments.
    """
    ap = argparse.ArgumentParser(
        prog="python -m gn_mx.convert",
        description="Rewrite the GroupNorm/InstanceNorm nodes of an exported MXNet model "
                    "(prefix-symbol.json + prefix-EPOCH.params) into gn_mx's gn_group_norm.")
    ap.add_argument("in_prefix")
    ap.add_argument("epoch", type=int)
    ap.add_argument("out_prefix")
    ap.add_argument("--fuse-activation", action="store_true",
                    help="fuse a norm followed by a relu or a swish (x * sigmoid(x)) into one op")
    ap.add_argument("--data-shape", action="append", type=_parse_shape, default=[],
                    metavar="NAME:D0,D1,...",
                    help="an input shape, when the channel count of a GroupNorm cannot be inferred "
                         "from the parameters alone")
    args = ap.parse_args(argv)
    import gn_mx  # noqa: F401  (registers gn_group_norm)
    sym, arg, aux = mx.model.load_checkpoint(args.in_prefix, args.epoch)
    report = ConversionReport()
    sym, arg, aux = convert_symbol(sym, arg, aux, fuse_activation=args.fuse_activation,
                                   data_shapes=dict(args.data_shape), report=report)
    mx.model.save_checkpoint(args.out_prefix, args.epoch, sym, arg, aux)
    print(report)
    print(f"wrote {args.out_prefix}-symbol.json and {args.out_prefix}-{args.epoch:04d}.params")
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
