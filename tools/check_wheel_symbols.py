"""What the wheel's libgn_mx.so needs from the system, and whether that fits a manylinux policy.

    python tools/check_wheel_symbols.py WHEEL_OR_SO [--max-glibc 2.17] [--json]

Reads the library's ELF dynamic section with pyelftools (auditwheel's own dependency) and checks:
  - the newest GLIBC_x.y symbol version it needs is <= --max-glibc (2.17: manylinux2014, the tag of
    MXNet's own 1.9.1 wheels);
  - no GLIBCXX_/CXXABI_/GCC_ version needs (the C++ runtime and libgcc are linked in, statically);
  - NEEDED only from ALLOWED_NEEDED (glibc's libraries and libgomp.so.1, the OpenMP runtime
    libmxnet.so itself uses);
  - no undefined, non-weak symbol without a version (one that no NEEDED library promises: it would
    fail to resolve when the library is loaded on an older system).
Exit status 0 when all hold, 1 otherwise (the report says which); --json prints the report as JSON.
tools/build_wheel.sh runs it on every wheel it makes; tests/test_wheel_symbols.py on the CPU wheel.
"""
import argparse
import io
import json
import re
import sys
import zipfile

LIB_IN_WHEEL = "gn_mx/libgn_mx.so"
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                  "ld-linux-x86-64.so.2", "libgomp.so.1"}
CXX_RUNTIME_VERSIONS = re.compile(r"^(GLIBCXX|CXXABI|GCC)_")


def _version_key(v):
    return tuple(int(x) for x in v.split("."))


def read_library(path):
    """The library's bytes: `path` itself, or gn_mx/libgn_mx.so inside a wheel."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            return z.read(LIB_IN_WHEEL)
    with open(path, "rb") as f:
        return f.read()


def inspect(data):
    """NEEDED, version needs per library, and unversioned non-weak undefined symbols."""
    from elftools.elf.dynamic import DynamicSection  # pyelftools: imported here, so that --help
    from elftools.elf.elffile import ELFFile         # works without it
    from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection
    elf = ELFFile(io.BytesIO(data))
    needed, version_needs, unversioned = [], {}, []
    for sec in elf.iter_sections():
        if isinstance(sec, DynamicSection):
            needed += [t.needed for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        elif isinstance(sec, GNUVerNeedSection):
            for verneed, auxes in sec.iter_versions():
                version_needs.setdefault(verneed.name, set()).update(a.name for a in auxes)
    dynsym = elf.get_section_by_name(".dynsym")
    versym = next((s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection)), None)
    for i, sym in enumerate(dynsym.iter_symbols()):
        if i == 0 or sym["st_shndx"] != "SHN_UNDEF" or sym["st_info"]["bind"] == "STB_WEAK":
            continue
        ndx = versym.get_symbol(i)["ndx"] if versym is not None else "VER_NDX_GLOBAL"
        if ndx in ("VER_NDX_LOCAL", "VER_NDX_GLOBAL", 0, 1):
            unversioned.append(sym.name)
    return needed, {k: sorted(v) for k, v in version_needs.items()}, sorted(unversioned)


def report(data, max_glibc):
    needed, version_needs, unversioned = inspect(data)
    glibc = sorted({v[len("GLIBC_"):] for vs in version_needs.values() for v in vs
                    if re.match(r"^GLIBC_\d+(\.\d+)+$", v)}, key=_version_key)
    newest = glibc[-1] if glibc else None
    above = [f"{v}@{lib}" for lib, vs in sorted(version_needs.items()) for v in vs
             if re.match(r"^GLIBC_\d", v) and _version_key(v[6:]) > _version_key(max_glibc)]
    cxx = [f"{v}@{lib}" for lib, vs in sorted(version_needs.items()) for v in vs
           if CXX_RUNTIME_VERSIONS.match(v)]
    problems = []
    if above:
        problems.append(f"needs glibc symbol versions newer than {max_glibc}: {' '.join(above)}")
    if cxx:
        problems.append(f"needs the system's C++ runtime / libgcc: {' '.join(cxx)}")
    extra = sorted(set(needed) - ALLOWED_NEEDED)
    if extra:
        problems.append(f"NEEDED outside glibc + libgomp: {' '.join(extra)}")
    if unversioned:
        problems.append("undefined symbols no NEEDED library versions (fail to load on an older "
                        f"system): {' '.join(unversioned[:20])}")
    return {"newest_glibc": newest, "max_glibc": max_glibc, "needed": needed,
            "version_needs": version_needs, "problems": problems, "ok": not problems}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a gn_mx wheel (.whl) or a libgn_mx.so")
    ap.add_argument("--max-glibc", default="2.17", help="newest allowed GLIBC_ version (2.17)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    r = report(read_library(a.path), a.max_glibc)
    if a.json:
        print(json.dumps(r, indent=1, sort_keys=True))
    else:
        print(f"newest GLIBC symbol version: {r['newest_glibc']} (allowed: <= {a.max_glibc})")
        print(f"NEEDED: {' '.join(r['needed'])}")
        for lib, vs in sorted(r["version_needs"].items()):
            print(f"  {lib}: {' '.join(vs)}")
        for p in r["problems"]:
            print(f"PROBLEM: {p}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
