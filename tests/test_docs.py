"""The documentation is checked, not hoped: the site builds with `mkdocs build --strict` (broken
links, missing pages, mkdocstrings errors fail it) and every code block a user would paste runs.

Blocks: each ```python block of README.md and docs/**/*.md runs; a page's blocks run in order in
one fresh interpreter (later blocks use earlier names), with a temporary directory as the working
directory. Each ```bash / ```sh block runs too, a page's shell blocks in order in one `bash -e`
from the repository root with this interpreter's directory first on PATH. A block that cannot run
here is marked by an HTML comment on the line right before its fence,

    <!-- skip: needs a GPU -->

and is reported as a skipped test with that reason; a skip marker without a reason fails. Other
fences (text, c, json, none) are not code to run.

A python block that the page offers to run "in a fresh process" (a model reload, say) is marked

    <!-- fresh-process -->

and runs ALONE in a new interpreter, at its place in the page's order, in the same working
directory (so it sees the files the blocks before it wrote, and none of their names): it must
import and define everything it uses, as a user pasting it into a new process would. A python
block whose introducing paragraph (the prose right before its fence) says "fresh process" must
carry that marker (or a skip marker), and the marker on anything but a python block fails.
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^\n]*$")
_SKIP = re.compile(r"^\s*<!--\s*skip\b(?P<rest>.*?)-->\s*$")
_FRESH = re.compile(r"^\s*<!--\s*fresh-process\s*-->\s*$")
_TIMEOUT_S = 600


def doc_files():
    files = [os.path.join(ROOT, "README.md")]
    for d, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.join(d, n) for n in names if n.endswith(".md")]
    return sorted(files)


def parse_blocks(path):
    """[(lang, first_line_number, code, skip_reason or None, marker_error or None, fresh)] of a
    file; ``fresh``: the block runs alone in a new process (its ``<!-- fresh-process -->``)."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, i, prose_start = [], 0, 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group("indent")), m.group("fence"), m.group("lang").lower()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        skip, error = None, None
        prev = lines[i - 1] if i > 0 else ""
        sm = _SKIP.match(prev)
        if sm:
            rest = sm.group("rest").strip()
            if not rest.startswith(":") or not rest[1:].strip():
                error = f"skip marker without a reason: {prev.strip()!r} (write <!-- skip: why -->)"
            else:
                skip = rest[1:].strip()
        fresh = bool(_FRESH.match(prev))
        if fresh and lang not in PYTHON_LANGS:
            error = f"a fresh-process marker on a {lang or 'plain'} block (python blocks only)"
        intro = _paragraph_before(lines[prose_start:i - 1 if (sm or fresh) else i])
        if lang in PYTHON_LANGS and not (fresh or sm) and "fresh process" in intro.lower():
            error = ("its introduction says 'fresh process' but the block has no "
                     "<!-- fresh-process --> marker (it would run in the page's interpreter)")
        blocks.append((lang, i + 1, "\n".join(body) + "\n", skip, error, fresh))
        i = j + 1
        prose_start = i
    return blocks


def _paragraph_before(lines):
    """The last paragraph of ``lines`` (the prose introducing a block), as one string."""
    para = []
    for line in reversed(lines):
        if not line.strip():
            if para:
                break
            continue
        para.append(line)
    return " ".join(reversed(para))


def _rel(path):
    return os.path.relpath(path, ROOT)


def _cases():
    runs, skips, errors = [], [], []
    for path in doc_files():
        blocks = parse_blocks(path)
        for kind, langs in (("python", PYTHON_LANGS), ("shell", SHELL_LANGS)):
            mine = [b for b in blocks if b[0] in langs]
            if any(b[3] is None and b[4] is None for b in mine):
                runs.append(pytest.param(path, kind, id=f"{_rel(path)}:{kind}"))
            for lang, line, _, skip, error, _ in mine:
                if error:
                    errors.append(f"{_rel(path)}:{line}: {error}")
                elif skip:
                    skips.append(pytest.param(path, line, skip, id=f"{_rel(path)}:{line}"))
    return runs, skips, errors


RUNS, SKIPS, MARKER_ERRORS = _cases()


def _env(tmp):
    # TMPDIR: what the blocks create with mktemp / tempfile goes into the page's own directory,
    # removed after the page ran.
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1", TMPDIR=tmp)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _python_driver(path, blocks):
    """One script that executes the page's blocks in order in one namespace, each compiled under
    its own file:line name so that a traceback points at the block in the Markdown file."""
    parts = ["import subprocess, sys", "__ns = {'__name__': '__main__'}", _FRESH_RUNNER]
    for _, line, code, _, _, fresh in blocks:
        name = f"{_rel(path)}:{line}"
        parts.append(f"print('--- block {name}' + {' (fresh process)' if fresh else ''!r}, "
                     "flush=True)")
        if fresh:
            parts.append(f"__fresh({code!r}, {name!r})")
        else:
            parts.append(f"exec(compile({code!r}, {name!r}, 'exec'), __ns)")
    return "\n".join(parts) + "\n"


# The driver's runner of a fresh-process block: a new interpreter, same working directory and
# environment, the block's code compiled under its file:line name (tracebacks point at the page).
_FRESH_RUNNER = """
def __fresh(code, name):
    src = 'exec(compile(' + repr(code) + ', ' + repr(name) + ', "exec"))'
    proc = subprocess.run([sys.executable, '-c', src], capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode:
        raise SystemExit(f'the fresh-process block {name} failed (exit {proc.returncode})')
"""


def _run(cmd, cwd, what, tmp):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(tmp), capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    assert proc.returncode == 0, (f"{what} failed (exit {proc.returncode})\n--- stdout\n"
                                  f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def _run_page(path, kind):
    """Run a page's python (or shell) blocks, in order, in one fresh interpreter (or shell)."""
    langs = PYTHON_LANGS if kind == "python" else SHELL_LANGS
    blocks = [b for b in parse_blocks(path) if b[0] in langs and b[3] is None and b[4] is None]
    work = tempfile.mkdtemp(prefix="gn_mx_docs_")
    try:
        if kind == "python":
            script = os.path.join(work, "page.py")
            with open(script, "w") as f:
                f.write(_python_driver(path, blocks))
            return _run([sys.executable, script], work, f"the python blocks of {_rel(path)}", work)
        script = os.path.join(work, "page.sh")
        with open(script, "w") as f:
            f.write("set -eo pipefail\n" + "".join(
                f"echo '--- block {_rel(path)}:{line}'\n{code}"
                for _, line, code, _, _, _ in blocks))
        return _run(["bash", script], ROOT, f"the shell blocks of {_rel(path)}", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_pool, _futures = None, {}


@pytest.fixture(scope="module")
def page_runner(request):
    """Runs the selected pages concurrently, a few at a time (most of a page's time is importing
    MXNet and waiting on subprocesses); each test waits for its own page and reports its own
    failure. Pages not started when the module ends (pytest -x) are cancelled."""
    selected = [item.callspec.params for item in request.session.items
                if getattr(item, "originalname", None) == "test_code_blocks_run"
                and item.module.__name__ == request.module.__name__]
    workers = min(3, (os.cpu_count() or 1) + 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {(p["path"], p["kind"]): pool.submit(_run_page, p["path"], p["kind"])
                   for p in selected}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("path, kind", RUNS)
def test_code_blocks_run(path, kind, page_runner):
    """A page's python (or shell) blocks, in order, in one fresh interpreter (or shell)."""
    page_runner[(path, kind)].result()


@pytest.mark.parametrize("path, line, reason", SKIPS)
def test_code_block_marked_skip(path, line, reason):
    """Blocks that cannot run here, listed with the reason their marker gives."""
    pytest.skip(f"{_rel(path)}:{line}: {reason}")


def test_skip_markers_have_reasons():
    assert not MARKER_ERRORS, "\n".join(MARKER_ERRORS)


def test_blocks_found():
    """The parser sees the pages' blocks (a test that finds none would pass vacuously)."""
    assert len(RUNS) >= 10, RUNS
    readme = parse_blocks(os.path.join(ROOT, "README.md"))
    assert any(b[0] in PYTHON_LANGS and b[3] is None for b in readme), readme


def test_parser_reads_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(textwrap.dedent("""\
        text
        <!-- skip: needs a GPU -->
        ```python
        a = 1
        ```
        <!-- skip -->
        ```bash
        b
        ```
        ```text
        c
        ```
        - item:

          ```python
          d = 2
          ```
        """))
    blocks = parse_blocks(str(page))
    assert [(b[0], b[2], b[3]) for b in blocks] == [
        ("python", "a = 1\n", "needs a GPU"), ("bash", "b\n", None), ("text", "c\n", None),
        ("python", "d = 2\n", None)]
    assert blocks[1][4] and "without a reason" in blocks[1][4]
    assert all(b[4] is None for b in blocks if b[1] != blocks[1][1])


def test_parser_reads_fresh_process_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(textwrap.dedent("""\
        <!-- fresh-process -->
        ```python
        a = 1
        ```
        Then, in a fresh process:

        ```python
        b = 2
        ```
        <!-- fresh-process -->
        ```bash
        c
        ```
        Reload it in a fresh process:
        <!-- skip: a reason -->
        ```python
        d = 3
        ```
        """))
    blocks = parse_blocks(str(page))
    assert [(b[2], b[5]) for b in blocks] == [("a = 1\n", True), ("b = 2\n", False),
                                               ("c\n", True), ("d = 3\n", False)]
    assert blocks[0][4] is None and blocks[3][4] is None
    assert "says 'fresh process' but the block has no" in blocks[1][4]
    assert "fresh-process marker on a bash block" in blocks[2][4]


def test_fresh_process_block_runs_alone(tmp_path):
    """A fresh-process block sees the files of the blocks before it, not their names; the blocks
    after it continue in the page's interpreter."""
    page = tmp_path / "p.md"
    ok = textwrap.dedent("""\
        ```python
        secret = 41
        open('f.txt', 'w').write(str(secret + 1))
        ```
        <!-- fresh-process -->
        ```python
        import sys
        print('FRESH', open('f.txt').read(), 'secret' in dir())
        ```
        ```python
        print('AFTER', secret)
        ```
        """)
    page.write_text(ok)
    out = _run_page(str(page), "python").stdout
    assert "FRESH 42 False" in out and "AFTER 41" in out, out
    page.write_text(ok.replace("'secret' in dir()", "secret"))
    with pytest.raises(AssertionError) as e:
        _run_page(str(page), "python")
    assert "NameError: name 'secret' is not defined" in str(e.value), str(e.value)[-2000:]
    assert "the fresh-process block" in str(e.value)


def test_fresh_process_blocks_found():
    """The docs' reload blocks are marked (README, quickstart, DBN, replace_norm at least)."""
    marked = {_rel(p) for p in doc_files() for b in parse_blocks(p) if b[5] and b[3] is None}
    assert {"README.md", "docs/quickstart.md", "docs/dbn.md",
            "docs/guide/replace_norm.md"} <= marked, marked


DOCS_TOOLCHAIN_PYTHON = (3, 11)  # requirements-dev.txt installs the docs toolchain from here on


def require_docs_toolchain():
    """Skip (with the reason) where requirements-dev.txt does not install the docs toolchain
    (Python < 3.11); where it does, a missing package is a failure, not a skip."""
    if sys.version_info[:2] < DOCS_TOOLCHAIN_PYTHON:
        pytest.skip("the docs toolchain (mkdocs, mkdocstrings, griffelib) is installed on Python "
                    ">= 3.11 only: griffelib 2.4 needs 3.11 (requirements-dev.txt)")
    import importlib
    for mod in ("mkdocs", "mkdocstrings", "griffe"):
        importlib.import_module(mod)


def test_mkdocs_build_strict():
    """`mkdocs build --strict` into a temporary directory: broken links, pages missing from the
    navigation and mkdocstrings errors fail it (the configuration sets the validation levels)."""
    require_docs_toolchain()
    site = tempfile.mkdtemp(prefix="gn_mx_site_")
    try:
        proc = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site],
                    ROOT, "mkdocs build --strict", tempfile.gettempdir())
        for page in ("index.html", "reference/ops.html", "reference/python.html",
                     "performance/gpu.html", "benchmarks/results/group_norm_cpu.html"):
            assert os.path.isfile(os.path.join(site, page)), (page, proc.stderr[-3000:])
        api = open(os.path.join(site, "reference", "python.html"), encoding="utf-8").read()
        assert "gn_mx.nn.GroupNorm" in api and "num_groups" in api
    finally:
        shutil.rmtree(site, ignore_errors=True)


def test_readme_links_exist():
    """README.md is not part of the site (mkdocs checks the pages' links): its relative links
    must name files of the repository, and anchors into docs pages must exist there."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            bad.append(target)
        elif anchor and path.endswith(".md"):
            heads = re.findall(r"^#+ (.*)$", open(full, encoding="utf-8").read(), re.M)
            slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower())
                     for h in heads}
            if anchor not in slugs:
                bad.append(target)
    assert not bad, bad
