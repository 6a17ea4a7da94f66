"""MkDocs hook: publish the measured results that live outside docs/ at their repository paths.

`benchmarks/results/*` and `examples/results/*` are written by the benchmarks and examples and are
their one home; copying them into docs/ would make a second copy that goes stale. This hook adds
them to the site under the same paths (`benchmarks/results/group_norm_cpu.md` becomes a page,
`examples/results/small_batch.png` an image) and rewrites the pages' links to them: a page links
to a result the way it would in the repository (from docs/dbn.md: `../examples/results/...`), which
works when the Markdown is read on its own, and the site gets the link to its copy. Links that
leave docs/ for anything not published stay as written, so `mkdocs build --strict` reports them.
"""
import glob
import os
import re

from mkdocs.structure.files import File, InclusionLevel

_PATTERNS = ("benchmarks/results/*.md", "benchmarks/results/*.png",
             "examples/results/*.md", "examples/results/*.png")
_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_published = set()


def _root(config):
    return os.path.dirname(os.path.abspath(config["config_file_path"]))


def on_files(files, config):
    root = _root(config)
    _published.clear()
    for pattern in _PATTERNS:
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            _published.add(rel)
            files.append(File(rel, root, config["site_dir"], config["use_directory_urls"],
                              inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown, page, config, files):
    root, docs = _root(config), os.path.abspath(config["docs_dir"])
    if page.file.abs_src_path is None or not os.path.abspath(page.file.abs_src_path).startswith(docs):
        # A published result page: written by a benchmark as plain tables and text, with no links;
        # "[a][b]" in a formula there must not read as a reference link (mkdocs-autorefs would
        # report a missing target).
        return markdown.replace("][", "]\\[")
    page_dir = os.path.dirname(os.path.join(docs, page.file.src_path))

    def rewrite(m):
        target = m.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        rel = os.path.relpath(os.path.normpath(os.path.join(page_dir, target)), root)
        rel = rel.replace(os.sep, "/")
        if rel not in _published:
            return m.group(0)
        new = os.path.relpath(os.path.join(docs, rel), page_dir).replace(os.sep, "/")
        return m.group(1) + new + m.group(3)

    return _LINK.sub(rewrite, markdown)
