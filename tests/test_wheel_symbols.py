"""The wheel's reach, checked in every CI run: manylinux2014 (glibc 2.17), no C++ runtime imports.

The CPU wheel is the one tests/test_wheel.py builds (same fixture, same cached build). Checked:
  - tools/check_wheel_symbols.py passes at glibc 2.17: newest GLIBC_ version <= 2.17, no GLIBCXX_/
    CXXABI_/GCC_ needs, NEEDED only glibc + libgomp.so.1, no unversioned undefined symbols;
  - `auditwheel show` (the tool pip's tags come from) places it in manylinux_2_17;
  - BUILD_REPORT.txt says what was reached, honestly (its policy and newest version are the above);
  - the checker itself fails a library linked against this machine's glibc and C++ runtime (the
    development build), and tools/build_wheel.sh fails when GNMX_WHEEL_MAX_POLICY is below what
    the wheel reaches (the guard that stops a toolchain change from narrowing who can install it).
"""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from test_wheel import wheel, wheel_build_env, wheel_tools_bin  # noqa: F401 (the fixture)

CHECK = os.path.join(ROOT, "tools", "check_wheel_symbols.py")


def _check(path, *args):
    r = subprocess.run([sys.executable, CHECK, "--json", *args, path], capture_output=True,
                       text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_wheel_library_needs_glibc_2_17_at_most_and_no_cxx_runtime(wheel):
    rc, rep = _check(wheel, "--max-glibc", "2.17")
    assert rc == 0 and rep["ok"], rep["problems"]
    newest = tuple(int(x) for x in rep["newest_glibc"].split("."))
    assert (2, 2) <= newest <= (2, 17), rep
    libs = set(rep["version_needs"])
    assert not [v for vs in rep["version_needs"].values() for v in vs
                if v.startswith(("GLIBCXX", "CXXABI", "GCC_"))], rep
    assert "libstdc++.so.6" not in rep["needed"] and "libgcc_s.so.1" not in rep["needed"], rep
    # libgomp: external, and only the OpenMP 4.0 entry points of GCC >= 4.9's runtime.
    assert "libgomp.so.1" in rep["needed"] and libs <= {
        "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
        "ld-linux-x86-64.so.2", "libgomp.so.1"}, rep
    assert set(rep["version_needs"]["libgomp.so.1"]) <= {"GOMP_1.0", "GOMP_4.0", "OMP_1.0"}, rep


def test_auditwheel_places_the_wheel_in_manylinux2014(wheel):
    """auditwheel's own reading, libgomp.so.1 left external (searched for in glibc 2.17's stubs
    only, as tools/build_wheel.sh does: this machine's libgomp has its own, newer glibc needs)."""
    auditwheel = os.path.join(wheel_tools_bin(), "auditwheel")
    stubs = os.path.join(ROOT, "build", "glibc-2.17", "lib")
    if not os.path.exists(auditwheel) or not os.path.isdir(stubs):
        pytest.skip("auditwheel / the glibc 2.17 stubs are made by tools/build_wheel.sh")
    r = subprocess.run([auditwheel, "show", "--ldpaths", stubs, wheel], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = " ".join(r.stdout.split())
    assert 'constrains the platform tag to "manylinux_2_17_x86_64"' in text, text[:3000]


def test_build_report_says_what_was_reached(wheel):
    with open(os.path.join(os.path.dirname(wheel), "BUILD_REPORT.txt")) as f:
        report = f.read()
    _, rep = _check(wheel)
    assert re.search(r"^result: ok$", report, re.M), report
    assert re.search(r"^policy: manylinux_2_17_x86_64 \(auditwheel; allowed: manylinux_2_17 or "
                     r"older\)$", report, re.M), report
    assert f"newest GLIBC symbol version: {rep['newest_glibc']} (allowed: <= 2.17)" in report
    assert re.search(r"^compiler: g\+\+.*11\.", report, re.M), report


def test_the_check_fails_a_library_linked_against_this_machines_glibc():
    """The development build (host glibc, shared libstdc++ allowed): the checker must say no."""
    libs = glob.glob(os.path.join(ROOT, "python", "gn_mx", "libgn_mx.so"))
    if not libs:
        pytest.skip("no development build (bash dev.sh builds python/gn_mx/libgn_mx.so)")
    rc, rep = _check(libs[0], "--max-glibc", "2.17")
    newest = tuple(int(x) for x in rep["newest_glibc"].split("."))
    if newest <= (2, 17) and "libstdc++.so.6" not in rep["needed"]:
        pytest.skip(f"this machine's glibc/C++ runtime need nothing newer (GLIBC {newest})")
    assert rc == 1 and not rep["ok"] and rep["problems"], rep


def test_build_fails_when_the_policy_is_above_the_allowed_one(wheel, tmp_path):
    """GNMX_WHEEL_MAX_POLICY=manylinux_2_5 (older than the wheel can be): the build must fail,
    say why in BUILD_REPORT.txt and leave no wheel (incremental: the CMake build is reused)."""
    out = tmp_path / "out"
    env = wheel_build_env(GNMX_WHEEL_OUT=str(out), GNMX_WHEEL_MAX_POLICY="manylinux_2_5")
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "build_wheel.sh"), "--cpu"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 1, (r.stdout + r.stderr)[-4000:]
    report = (out / "BUILD_REPORT.txt").read_text()
    assert re.search(r"^result: FAILED: policy manylinux_2_17_x86_64 is newer than "
                     r"GNMX_WHEEL_MAX_POLICY=manylinux_2_5(; |$)", report, re.M), report
    assert not list(out.glob("*.whl")) and not (out / "SHA256SUMS").exists()
