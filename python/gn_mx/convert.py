"""Command line: ``python -m gn_mx.convert in-prefix epoch out-prefix [--fuse-activation]``.

Rewrites an exported model's GroupNorm/InstanceNorm nodes into gn_mx's gn_group_norm (see
docs/convert.md). The functions live in gn_mx._convert and are ``gn_mx.convert`` /
``gn_mx.convert_symbol``; this module is callable as ``gn_mx.convert`` too, so an explicit
``import gn_mx.convert`` (which rebinds the package attribute to this module) changes nothing.
"""
import sys
import types

from ._convert import ConversionReport, convert, convert_symbol, main  # noqa: F401

__all__ = ["convert", "convert_symbol", "ConversionReport", "main"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
