"""docs/contributing.md's layout map names every tracked file (git ls-files) with one line on its
job, and no line names a file that is gone: the map cannot go stale unnoticed.

The map is the fenced block under "## Layout": each line that starts in column 0 begins with a path
or a glob (fnmatch: `*` crosses folders) and its job; a path ending in "/" is a folder rule line
(what every file there obeys) and matches nothing by itself; indented lines continue the one above.
"""
import fnmatch
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "contributing.md")


def map_patterns():
    text = open(DOC).read()
    m = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/contributing.md: no fenced layout block under '## Layout'"
    pats = [line.split()[0] for line in m.group(1).splitlines() if line[:1] not in ("", " ")]
    return [p for p in pats if not p.endswith("/")]


def tracked_files():
    if not shutil.which("git") or not os.path.isdir(os.path.join(ROOT, ".git")) and \
            not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the map is checked against git ls-files")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_layout_map_lists_every_tracked_file():
    pats = map_patterns()
    missing = [f for f in tracked_files() if not any(fnmatch.fnmatch(f, p) for p in pats)]
    assert not missing, ("docs/contributing.md's layout map has no line for these tracked files "
                         "(add one each: the path, then its job):\n  " + "\n  ".join(missing))


def test_layout_map_names_no_missing_file():
    files = tracked_files()
    stale = [p for p in map_patterns() if not any(fnmatch.fnmatch(f, p) for f in files)]
    assert not stale, ("docs/contributing.md's layout map names paths that match no tracked file "
                       "(remove or correct them):\n  " + "\n  ".join(stale))
