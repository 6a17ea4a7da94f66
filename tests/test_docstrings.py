"""The public API's docstrings: every public class and function of gn_mx has a NumPy-style docstring
whose Parameters section names exactly the signature's parameters (what mkdocstrings renders in
the API reference), and the ``>>>`` examples in them run (doctest)."""
import doctest
import importlib
import inspect
import re

import numpy as np
import pytest

import mxnet as mx

import gn_mx

#: The public modules (the reference documents these) besides the package itself.
MODULES = ["gn_mx.nn", "gn_mx.ops", "gn_mx.sym", "gn_mx.amp", "gn_mx.zoo", "gn_mx.parallel", "gn_mx.ws",
           "gn_mx.convert", "gn_mx.onnx"]
#: Objects that need no Examples (nor Returns) section: the command-line entry point.
NO_EXAMPLE = {"gn_mx.convert.main"}


def _modules():
    mods = [gn_mx]
    for name in MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ImportError as e:  # gn_mx.onnx without onnx installed
            if name != "gn_mx.onnx":
                raise
            print("skipping %s: %s" % (name, e))
    return mods


def _public(module):
    """(qualified name, object) of the module's public classes and functions: its ``__all__``."""
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module.__name__} has no __all__"
    found = []
    for n in names:
        obj = getattr(module, n)
        if inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj) and not inspect.ismodule(obj):
            found.append((f"{module.__name__}.{n}", obj))
    return found


def _methods(cls):
    """Public methods defined in the class itself (not inherited, no dunders)."""
    for n, v in vars(cls).items():
        if n.startswith("_"):
            continue
        f = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
        if inspect.isfunction(f):
            yield n, f


_SECTION = re.compile(r"^(\w[\w ]*)\n-{3,}\n", re.M)


def sections(doc):
    """{section title: body} of a NumPy-style docstring (after inspect.cleandoc)."""
    parts = _SECTION.split(doc)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def documented_params(doc):
    """The names the Parameters section documents ('*args' / '**kwargs' kept with their stars)."""
    body = sections(doc).get("Parameters", "")
    names = []
    for line in body.splitlines():
        if not line or line[0] == " ":
            continue
        head = line.split(" : ")[0].strip()
        names += [n.strip() for n in head.split(",")]
    return names


def signature_params(obj):
    if inspect.isclass(obj) and "__init__" not in vars(obj):
        return []  # the base class's constructor (documented there)
    target = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(target)
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        star = "*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else ""
        out.append(star + p.name)
    return out


def _all_objects():
    objs = {}
    for m in _modules():
        for qual, obj in _public(m):
            objs.setdefault(qual, obj)
    return objs


def test_public_api_is_documented():
    objs = _all_objects()
    assert len(objs) >= 30, sorted(objs)
    problems = []
    for qual, obj in sorted(objs.items()):
        doc = inspect.getdoc(obj)
        own = obj.__doc__ if not inspect.isclass(obj) else vars(obj).get("__doc__")
        if not doc or not own:
            problems.append(f"{qual}: no docstring")
            continue
        summary = doc.splitlines()[0]
        if not summary.strip():
            problems.append(f"{qual}: empty summary line")
        secs = sections(doc)
        params = signature_params(obj)
        if params:
            if "Parameters" not in secs:
                problems.append(f"{qual}: parameters {params} but no Parameters section")
            else:
                named = documented_params(doc)
                extra = [n for n in named if n not in params]
                missing = [n for n in params if n not in named]
                if extra:
                    problems.append(f"{qual}: Parameters names {extra}, not in the signature {params}")
                if missing:
                    problems.append(f"{qual}: signature parameters {missing} not documented")
        if inspect.isroutine(obj) and "Returns" not in secs and qual not in NO_EXAMPLE:
            problems.append(f"{qual}: no Returns section")
        if qual not in NO_EXAMPLE and ">>>" not in secs.get("Examples", ""):
            problems.append(f"{qual}: no Examples section with >>> lines")
        if inspect.isclass(obj):
            for n, f in _methods(obj):
                if not inspect.getdoc(f):
                    problems.append(f"{qual}.{n}: no docstring")
                elif "Parameters" in sections(inspect.getdoc(f)):
                    extra = [p for p in documented_params(inspect.getdoc(f))
                             if p not in signature_params(f)]
                    if extra:
                        problems.append(f"{qual}.{n}: Parameters names {extra}, not in the signature")
    assert not problems, "\n".join(problems)


def test_documented_params_parser_catches_a_wrong_name():
    """The check above can fail: a docstring naming a parameter the signature lacks."""
    def f(a, b=1, **kwargs):
        """Summary.

        Parameters
        ----------
        a : int
        c, b : float
            Two at once.
        **kwargs
            Passed on.
        """
    named = documented_params(inspect.getdoc(f))
    assert named == ["a", "c", "b", "**kwargs"]
    assert [n for n in named if n not in signature_params(f)] == ["c"]


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    seen, tests = set(), []
    for qual, obj in sorted(_all_objects().items()):
        targets = [(qual, obj)]
        if inspect.isclass(obj):
            targets += [(f"{qual}.{n}", f) for n, f in _methods(obj)]
        for name, o in targets:
            for t in finder.find(o, name=name, globs={}):
                if t.examples and id(t.docstring) not in seen:
                    seen.add(id(t.docstring))
                    tests.append(t)
    return tests


def test_doctest_examples_run():
    tests = _doctests()
    n_examples = sum(len(t.examples) for t in tests)
    assert len(tests) >= 25 and n_examples >= 100, (len(tests), n_examples)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = []
    np_mode = mx.util.is_np_array()
    for t in tests:
        t.globs = {"mx": mx, "np": np, "gn_mx": gn_mx}
        out = []
        mx.random.seed(0)
        np.random.seed(0)
        result = runner.run(t, out=out.append, clear_globs=True)
        if result.failed:
            failures.append("".join(out))
        assert mx.util.is_np_array() == np_mode, f"{t.name} left the NumPy interface switched"
    print(f"{len(tests)} docstrings, {n_examples} examples")
    assert not failures, "\n".join(failures)


def test_griffe_parses_the_docstrings_without_warnings():
    """What mkdocstrings (numpy style) sees: griffe's parser warns on a documented parameter the
    signature lacks and on malformed sections."""
    from test_docs import require_docs_toolchain
    require_docs_toolchain()
    import griffe
    import logging
    pkg = griffe.load("gn_mx", docstring_parser="numpy", resolve_aliases=False)
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = H()
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    n_parsed = 0
    try:
        objs = _all_objects()
        for qual in sorted(objs):
            path = qual.split(".", 1)[1]
            try:
                node = pkg[path]
            except (KeyError, Exception):  # noqa: BLE001 - alias not resolvable statically
                continue
            target = getattr(node, "final_target", node)
            parsed = [target] + [m for m in getattr(target, "members", {}).values()
                                 if not m.is_alias and not m.name.startswith("_")]
            for obj in parsed:
                if obj.docstring is not None:
                    obj.docstring.parse("numpy")
                    n_parsed += 1
    finally:
        logger.removeHandler(handler)
    assert not records, "\n".join(records)
    assert n_parsed >= 30, n_parsed
