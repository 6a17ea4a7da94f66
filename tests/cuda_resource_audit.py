"""Per-architecture resource audit of every CUDA kernel, without a GPU.

For each architecture of a toolkit's default list (CMakeLists.txt, by nvcc release; or --archs),
every source of src/operator/kernels/cuda_sources.txt is compiled to PTX (cicc, compute_XX) and the
PTX to SASS (ptxas -v, sm_XX) with the build's flags, and every kernel entry is checked:

  * a block size: the entry declares __launch_bounds__ (PTX .maxntid), and the registers of a
    block of that size fit the register file (64 K per block on sm_50..sm_90, allocated per warp in
    units of 256);
  * no spills, no stack frame, no local memory, unless the kernel is in the allowlist
    (tests/cuda_resource_allowlist.txt: one line per exception, with the reason);
  * static shared memory <= 48 KB, and static + the largest planned dynamic shared memory within
    48 KB, or within the architecture's opt-in maximum for a kernel whose limit is raised with
    cudaFuncSetAttribute; the planned dynamic sizes come from dbn_cuda.cu's own formulas
    (gram_smem, apply_smem, eig_smem, kTileBytes), evaluated by a host probe built with the CPU
    emulator's rewrite (tests/gpu/emu/build_emu.py), and every launch with a non-zero dynamic size
    in the sources must be one the plan covers;
  * the ZCA shared-memory eigensolver's largest D per architecture, as dbn.h (and docs/design/dbn.md)
    state it, equals what eig_smem and eig_kernel's static shared memory allow;
  * no half-precision arithmetic and no atomics in the code for sm_50/52/60 (PTX, and SASS when
    the toolkit has cuobjdump), and no atomics anywhere (PTX; SASS also read for sm_50/52/60).

Results are cached under build/resource-audit/<nvcc release>/<hash> (the hash covers every file
under src/operator, the flags, nvcc and CACHE_FORMAT): an unchanged tree recompiles nothing, and
the checks always run afresh on the cached ptxas reports.

  python tests/cuda_resource_audit.py [--nvcc PATH] [--ccbin g++-11] [--archs 50,60,...]
                                      [--sources a.cu ...] [--json out.json] [--jobs N]
Exit status 0: every check passed; 1: a check failed (each failure printed); 2: usage/tool error.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KDIR = os.path.join(ROOT, "src", "operator", "kernels")
ALLOWLIST = os.path.join(HERE, "cuda_resource_allowlist.txt")
DEFAULT_CACHE = os.path.join(ROOT, "build", "resource-audit")
FLAGS = ["-O3", "-DNDEBUG", "-std=c++17", "-DGNMX_WITH_CUDA", "-I", os.path.join(ROOT, "src", "operator")]

# Hardware facts (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
REGS_PER_BLOCK = 65536
REG_ALLOC_UNIT = 256           # registers are allocated per warp in units of 256 (sm_50 .. sm_90)
SMEM_DEFAULT = 48 * 1024       # without cudaFuncSetAttribute; also the limit of static shared memory
SMEM_OPTIN = {50: 49152, 52: 49152, 53: 49152, 60: 49152, 61: 49152, 62: 49152, 70: 98304,
              72: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
              100: 232448, 103: 232448, 110: 232448, 120: 101376, 121: 101376}
NO_HALF_ARCHS = (50, 52, 60)   # GPUs where gn_mx must widen fp16 (no or slow fp16 arithmetic)
CACHE_FORMAT = 4               # of compile_one's cached results

HALF_PTX = re.compile(r"^\s*(?:@!?%p\d+\s+)?(add|sub|mul|fma|neg|abs|min|max|setp|set|ex2|tanh|rcp|"
                      r"sqrt|div|testp|copysign)(\.[a-z0-9]+)*\.(f16|f16x2|bf16|bf16x2)\b", re.M)
ATOM_PTX = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.[\w.]+", re.M)
# SASS instruction lines ("/*0a10*/  HFMA2 R2, ...;"): the opcode after the address comment.
HALF_SASS = re.compile(r"\*/\s+(?:@!?P\w+\s+)?(HADD2|HMUL2|HFMA2|HSET2|HSETP2|HMNMX2)\b")
ATOM_SASS = re.compile(r"\*/\s+(?:@!?P\w+\s+)?(ATOM|ATOMS|ATOMG|RED)\b")
# fp16 -> fp32 conversion on sm_60+ is "HADD2.F32 Rd, Rs.H0_H0, -RZ.H0_H0" (x + -0 in float): a
# conversion, not half arithmetic (seen in the CUDA 11.8 sm_60 SASS of every fp16 kernel).
HALF_TO_FLOAT_SASS = re.compile(r"\bHADD2\.F32\b[^;]*-RZ")


def half_sass(line):
    """Whether a SASS line is half-precision arithmetic (not the fp16 -> fp32 conversion idiom)."""
    return bool(HALF_SASS.search(line)) and not HALF_TO_FLOAT_SASS.search(line)
# A launch `name<targs><<<config>>>`: template arguments hold no ';', parentheses or braces (so that
# `const IterArgs<A>& a, ...) { ... iternorm_kernel<A, S><<<` names iternorm_kernel, not IterArgs).
LAUNCH = re.compile(r"\b([A-Za-z_]\w*)(?:<[^;(){}]*?>)?<<<([^;]*?)>>>", re.S)


# ------------------------------------------------------------------------------------------------
# Inputs


def cuda_sources():
    """The one list of CUDA sources (CMakeLists.txt, tests/gpu/build.sh and the emulator read it)."""
    with open(os.path.join(KDIR, "cuda_sources.txt")) as f:
        names = [line.split("#", 1)[0].strip() for line in f]
    return [os.path.join(KDIR, n) for n in names if n]


def nvcc_release(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise SystemExit(f"cuda_resource_audit: cannot read the release of {nvcc}")
    return int(m.group(1)), int(m.group(2))


def default_archs(release):
    """CMakeLists.txt's default CUDA_ARCHITECTURES for this nvcc release (its one home)."""
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    block = text[text.index("if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES"):]
    rules = re.findall(r'(?:(?:else)?if\(_nvcc_ver VERSION_GREATER_EQUAL ([\d.]+)\)|(else)\(\))'
                       r'[^\n]*\n\s*set\(_archs "([\d;]+)"\)', block)
    for ver, is_else, archs in rules:
        if is_else or release >= tuple(int(v) for v in ver.split(".")):
            return [int(a) for a in archs.split(";")]
    raise SystemExit("cuda_resource_audit: no default architecture list found in CMakeLists.txt")


def inputs_hash(nvcc, ccbin, sources):
    """Everything a cached compile result depends on: flags, nvcc, every file under src/operator,
    the sources, and CACHE_FORMAT (bump it when compile_one's extraction changes)."""
    h = hashlib.sha256(" ".join(FLAGS + [ccbin or "", f"format {CACHE_FORMAT}"]).encode())
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    files = [os.path.abspath(s) for s in sources]
    for base, _, names in os.walk(os.path.join(ROOT, "src", "operator")):
        files += [os.path.join(base, n) for n in names if n.endswith((".h", ".cuh", ".cu", ".txt"))]
    for p in sorted(set(files)):
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# Compilation (cached)


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def compile_one(nvcc, ccbin, src, arch, out):
    """PTX (compute_arch) and ptxas -v log (sm_arch) of src, plus whether its SASS has fp16
    arithmetic / atomics (None without cuobjdump); cached in `out`."""
    stem = os.path.join(out, f"{os.path.basename(src)}.sm_{arch}")
    done = stem + ".json"
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    bindir = os.path.dirname(os.path.realpath(nvcc))
    ptxas = os.path.join(bindir, "ptxas")
    if not os.access(ptxas, os.X_OK):
        ptxas = shutil.which("ptxas") or ptxas
    cmd = [nvcc, "-ptx", f"-arch=compute_{arch}"] + FLAGS + (["-ccbin", ccbin] if ccbin else [])
    if arch < 60:
        cmd.append("-Wno-deprecated-gpu-targets")
    _run(cmd + [src, "-o", stem + ".ptx"])
    log = _run([ptxas, "-v", f"-arch=sm_{arch}", stem + ".ptx", "-o", stem + ".cubin"])
    sass = None
    cuobjdump = os.path.join(bindir, "cuobjdump")
    # The SASS is read where its half-precision check applies (NO_HALF_ARCHS): disassembling
    # group_norm_cuda.cu's cubin takes ~50 s per architecture (130 MB of text), and atomics are
    # checked on the PTX everywhere (SASS atomics only come from PTX atom / red).
    if arch in NO_HALF_ARCHS and os.access(cuobjdump, os.X_OK):
        text = _run([cuobjdump, "-sass", stem + ".cubin"])
        sass = {"half": sorted({ln.split(";")[0].strip() for ln in text.splitlines()
                                if half_sass(ln)})[:5],
                "atomics": sorted({ln.split(";")[0].strip() for ln in text.splitlines()
                                   if ATOM_SASS.search(ln)})[:5]}
    with open(stem + ".ptx") as f:
        ptx = f.read()
    res = {"ptx_entries": ptx_entries(ptx), "ptxas": log,
           "ptx_half": sorted({m.group(0).strip().split()[0] for m in HALF_PTX.finditer(ptx)}),
           "ptx_atomics": sorted({m.group(0).strip().split()[-1] for m in ATOM_PTX.finditer(ptx)}),
           "sass": sass}
    os.remove(stem + ".cubin")
    os.remove(stem + ".ptx")
    with open(done + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(done + ".tmp", done)
    return res


def ptx_entries(ptx):
    """{mangled entry name: .maxntid x*y*z or None} of a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)\s*([^{]*)\{", ptx, re.S):
        nt = re.search(r"\.maxntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", m.group(3))
        out[m.group(1)] = int(nt.group(1)) * int(nt.group(2)) * int(nt.group(3)) if nt else None
    return out


def parse_ptxas(log):
    """{mangled function: {regs, smem, stack, spill_st, spill_ld, lmem}} of a ptxas -v log
    (entries and non-inlined device functions)."""
    funcs, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            cur = funcs.setdefault(m.group(1), {"regs": 0, "smem": 0, "stack": 0, "spill_st": 0,
                                                "spill_ld": 0, "lmem": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
            lm = re.search(r"(\d+) bytes lmem", line)
            cur["lmem"] = int(lm.group(1)) if lm else 0
    return funcs


def kernel_short_name(kname):
    """'gram_kernel' of 'void gn_mx::(anonymous namespace)::gram_kernel<float, ...>(...)'."""
    m = re.search(r"::(\w+)[<(]", kname) or re.match(r"(?:void )?(\w+)", kname)
    return m.group(1) if m else kname


def demangle(names):
    if not names:
        return {}
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


# ------------------------------------------------------------------------------------------------
# The dynamic shared-memory plan: dbn_cuda.cu's formulas, evaluated on the host

PROBE_MAIN = r"""
#include <cstdio>
int main() {
  using namespace gn_mx;
  std::printf("max_d %d\n", kMaxD);
  std::printf("tile_bytes %zu\n", kTileBytes);
  std::printf("eig_global %zu\n", eig_smem(kMaxD, false).bytes);
  for (int d = 1; d <= kMaxD; ++d) std::printf("eig_shared %d %zu\n", d, eig_smem(d, true).bytes);
  for (size_t acc : {size_t(4), size_t(8)}) {
    std::printf("gram 16 %zu %zu\ngram 32 %zu %zu\ngram 64 %zu %zu\n", acc, gram_smem<16>(acc), acc,
                gram_smem<32>(acc), acc, gram_smem<64>(acc));
    std::printf("apply 16 %zu %zu\napply 32 %zu %zu\napply 64 %zu %zu\n", acc, apply_smem<16>(acc),
                acc, apply_smem<32>(acc), acc, apply_smem<64>(acc));
  }
  return 0;
}
"""


def smem_plan(cache):
    """The sizes dbn_cuda.cu launches with: {'max_d', 'tile_bytes', 'eig_global', 'eig_shared':
    {D: bytes}, 'gram': {(TT, acc): bytes}, 'apply': {(TT, acc): bytes}}."""
    sys.path.insert(0, os.path.join(HERE, "gpu", "emu"))
    import build_emu
    os.makedirs(cache, exist_ok=True)
    exe = os.path.join(cache, "smem_probe")
    if not os.path.exists(exe):
        # dbn_cuda.cu with the probe's main, and the two host-side sources it calls into (linked,
        # never run: the probe only evaluates the size formulas).
        ccs = []
        build_emu.rewrite_headers(cache)  # dbn_cuda.cu's kernels in its dbn_*_cuda.cuh
        for name in ("dbn_cuda.cu", "cuda_util.cu", "cusolver_loader.cu"):
            path = os.path.join(KDIR, name)
            cc = os.path.join(cache, name + ".cc")
            with open(cc, "w") as f:
                f.write(f'#line 1 "{path}"\n' + build_emu.rewrite(path) +
                        (PROBE_MAIN if name == "dbn_cuda.cu" else ""))
            ccs.append(cc)
        gxx = shutil.which("g++")
        if not gxx:
            raise RuntimeError("g++ is needed for the shared-memory probe")
        _run([gxx, "-std=c++20", "-O0", "-w", "-mf16c", "-pthread", "-D__CUDACC__",
              "-DGNMX_WITH_CUDA", "-include", "cuda_emu.h",
              "-I", os.path.join(HERE, "gpu", "emu", "include"), "-I", KDIR,
              "-I", os.path.join(ROOT, "src", "operator")] + ccs + ["-o", exe + ".tmp", "-ldl"])
        os.replace(exe + ".tmp", exe)
    plan = {"eig_shared": {}, "gram": {}, "apply": {}}
    for line in _run([exe]).splitlines():
        w = line.split()
        if w[0] in ("max_d", "tile_bytes", "eig_global"):
            plan[w[0]] = int(w[1])
        elif w[0] == "eig_shared":
            plan["eig_shared"][int(w[1])] = int(w[2])
        else:
            plan[w[0]][(int(w[1]), int(w[2]))] = int(w[3])
    return plan


def _acc_bytes(t):
    return 8 if t.strip() == "double" else 4  # AccT: half -> float, float -> float, double


def planned_dynamic(name, plan, arch, static):
    """Largest dynamic shared memory a launch of this kernel asks for (0: none), or None when the
    kernel is not one whose plan is known."""
    m = re.search(r"::(gram|apply)_kernel<([^,]+), (?:true|false), (\d+)>", name)
    if m:
        return plan[m.group(1)][(int(m.group(3)), _acc_bytes(m.group(2)))]
    if re.search(r"::(bwd_small|iternorm)_kernel<", name):
        return plan["tile_bytes"]
    if re.search(r"::eig_kernel<", name):
        # The shared path runs only while eig_smem(D, true) fits the opt-in maximum less the static
        # size (eig_smem_limit); the global / cuSOLVER paths use eig_smem(D, false), largest at kMaxD.
        limit = SMEM_OPTIN[arch] - static
        shared = max([b for b in plan["eig_shared"].values() if b <= limit], default=0)
        return max(shared, plan["eig_global"])
    return None


def stated_eig_limits():
    """{arch: D} as dbn.h states the shared-memory eigensolver's limits (and docs/design/dbn.md repeats)."""
    out = {}
    for path in (os.path.join(KDIR, "dbn.h"), os.path.join(ROOT, "docs", "design", "dbn.md")):
        text = " ".join(open(path).read().replace("*", " ").split())
        m = re.search(r"D <= (\d+ on sm_.*?sm_90)", text)
        if not m:
            raise RuntimeError(f"{path}: the sentence with the eigensolver's D limits was not found")
        found = {}
        for d, archs in re.findall(r"(\d+) on (sm_[\d/]+)", m.group(1)):
            for a in archs[3:].split("/"):
                found[int(a)] = int(d)
        out[os.path.relpath(path, ROOT)] = found
    return out


def launches_with_dynamic_smem(sources):
    """Kernel names launched with a dynamic shared-memory argument other than 0."""
    names = set()
    for src in sources:
        text = open(src).read()
        for m in LAUNCH.finditer(text):
            args = [a.strip() for a in re.split(r",(?![^()<>]*[)>])", m.group(2))]
            if len(args) >= 3 and args[2] not in ("0", "0u"):
                names.add(m.group(1))
    return names


def opt_in_kernels(sources):
    """Kernel names whose dynamic shared-memory limit the code raises (cudaFuncSetAttribute)."""
    names = set()
    for src in sources:
        for m in re.finditer(r"cudaFuncSetAttribute\(\s*(\w+)", open(src).read()):
            names.add(m.group(1))
    return names


def read_allowlist(path=ALLOWLIST):
    """[(archs or None for all, kernel regex, {spill, stack, lmem}, max bytes, reason)] from the
    allowlist: 'archs | kernel regex | what | max bytes | reason' (blank and # lines ignored)."""
    out = []
    if not os.path.exists(path):
        return out
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split("|")]
        what = set(parts[2].replace(" ", "").split(",")) if len(parts) == 5 else set()
        if len(parts) != 5 or not parts[4] or not what <= {"spill", "stack", "lmem"} or \
                not parts[3].isdigit():
            raise RuntimeError(f"{path}: want 'archs | kernel regex | spill,stack,lmem | max bytes | "
                               f"reason': {line}")
        archs = None if parts[0] == "*" else {int(a) for a in parts[0].split(",")}
        out.append((archs, parts[1], what, int(parts[3]), parts[4]))
    return out


# ------------------------------------------------------------------------------------------------
# Checks


def audit(results, archs, plan, sources, allow):
    """results: {(src, arch): compile_one(...)} -> (rows, failures). rows: one dict per kernel/arch."""
    rows, failures = [], []
    dyn_launched = launches_with_dynamic_smem(sources)
    optin_names = opt_in_kernels(sources)
    funcs = {e for r in results.values() for e in r["ptx_entries"]}
    funcs |= {f for r in results.values() for f in parse_ptxas(r["ptxas"])}
    names = demangle(sorted(funcs))
    covered = set()

    def allowed(arch, kname, what, nbytes):
        return any((archs is None or arch in archs) and re.search(k, kname) and what in w and
                   nbytes <= cap for archs, k, w, cap, _ in allow)

    for (src, arch), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        props = parse_ptxas(r["ptxas"])
        base = os.path.basename(src)
        if arch in NO_HALF_ARCHS:
            if r["ptx_half"]:
                failures.append(f"sm_{arch} {base}: half-precision arithmetic in the PTX: {r['ptx_half']}")
            if r["sass"] and r["sass"]["half"]:
                failures.append(f"sm_{arch} {base}: half-precision SASS: {r['sass']['half']}")
        if r["ptx_atomics"] or (r["sass"] and r["sass"]["atomics"]):
            failures.append(f"sm_{arch} {base}: atomics: {r['ptx_atomics']} "
                            f"{r['sass']['atomics'] if r['sass'] else ''}")
        for fn, p in props.items():
            kname = names.get(fn, fn)
            for what, key in (("spill", "spill_st"), ("spill", "spill_ld"), ("stack", "stack"),
                              ("lmem", "lmem")):
                if p[key] and not allowed(arch, kname, what, p[key]):
                    failures.append(f"sm_{arch} {kname}: {p[key]} bytes {key.replace('_', ' ')} "
                                    f"(not in {os.path.relpath(ALLOWLIST, ROOT)})")
        for fn, nt in r["ptx_entries"].items():
            kname = names.get(fn, fn)
            p = props.get(fn)
            if p is None:
                failures.append(f"sm_{arch} {kname}: no ptxas report")
                continue
            row = dict(arch=arch, source=base, kernel=kname, threads=nt, **p)
            if nt is None:
                failures.append(f"sm_{arch} {kname}: no __launch_bounds__ (block size unknown)")
            else:
                warps = -(-nt // 32)
                per_warp = -(-p["regs"] * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
                row["block_regs"] = per_warp * warps
                if row["block_regs"] > REGS_PER_BLOCK:
                    failures.append(f"sm_{arch} {kname}: {p['regs']} registers x {nt} threads = "
                                    f"{row['block_regs']} > {REGS_PER_BLOCK}")
            short = kernel_short_name(kname)
            dyn = planned_dynamic(kname, plan, arch, p["smem"]) if plan else None
            if dyn is None:
                dyn = 0
                if short in dyn_launched:
                    failures.append(f"sm_{arch} {kname}: launched with dynamic shared memory the "
                                    "audit's plan does not cover (tests/cuda_resource_audit.py)")
            else:
                covered.add(short)
            limit = SMEM_OPTIN[arch] if short in optin_names else SMEM_DEFAULT
            row.update(dyn_smem=dyn, smem_limit=limit)
            if p["smem"] > SMEM_DEFAULT:
                failures.append(f"sm_{arch} {kname}: static shared memory {p['smem']} > {SMEM_DEFAULT}")
            if p["smem"] + dyn > limit:
                failures.append(f"sm_{arch} {kname}: shared memory {p['smem']} static + {dyn} "
                                f"dynamic > {limit}")
            rows.append(row)
    if plan:
        for name in sorted(dyn_launched - covered):
            failures.append(f"{name}: launched with dynamic shared memory but no such kernel audited")
    return rows, failures


def eig_limits(rows, plan, archs):
    """{arch: largest D of the shared-memory eigensolver} for every eig_kernel<A> (min over A)."""
    out = {}
    for arch in archs:
        statics = [r["smem"] for r in rows if r["arch"] == arch and "::eig_kernel<" in r["kernel"]]
        if not statics:
            continue
        limit = SMEM_OPTIN[arch] - max(statics)
        out[arch] = max([d for d, b in plan["eig_shared"].items() if b <= limit], default=0)
    return out


def check_eig_limits(computed, stated):
    failures = []
    for path, table in stated.items():
        for arch, d in sorted(computed.items()):
            if arch in table and table[arch] != d:
                failures.append(f"{path}: says D <= {table[arch]} on sm_{arch}; eig_smem and "
                                f"eig_kernel's static shared memory allow D <= {d}")
            elif arch not in table:
                failures.append(f"{path}: states no shared-eigensolver D limit for sm_{arch} "
                                f"(D <= {d} there)")
    return failures


def summary(rows, archs):
    lines = [f"{'arch':>5} {'kernels':>7} {'max regs':>8} {'max regs x block':>16} "
             f"{'max static smem':>15} {'max static+dyn':>14}"]
    for arch in archs:
        rs = [r for r in rows if r["arch"] == arch]
        if not rs:
            continue
        lines.append(f"sm_{arch:<3} {len(rs):>7} {max(r['regs'] for r in rs):>8} "
                     f"{max(r.get('block_regs', 0) for r in rs):>16} "
                     f"{max(r['smem'] for r in rs):>15} "
                     f"{max(r['smem'] + r['dyn_smem'] for r in rs):>14}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvcc", default=os.environ.get("NVCC") or shutil.which("nvcc"))
    ap.add_argument("--ccbin", default=None, help="host compiler for nvcc (g++-11 for CUDA 11.8)")
    ap.add_argument("--archs", default=None, help="comma-separated; default: CMakeLists.txt's list")
    ap.add_argument("--sources", nargs="*", default=None, help="default: cuda_sources.txt")
    ap.add_argument("--allowlist", default=ALLOWLIST)
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("GNMX_JOBS", "2")))
    ap.add_argument("--json", default=None, help="write the per-kernel table and failures here")
    a = ap.parse_args(argv)
    if not a.nvcc:
        print("cuda_resource_audit: nvcc not found (--nvcc or NVCC)", file=sys.stderr)
        return 2
    release = nvcc_release(a.nvcc)
    archs = [int(x) for x in a.archs.split(",")] if a.archs else default_archs(release)
    sources = [os.path.abspath(s) for s in a.sources] if a.sources else cuda_sources()
    unknown = [x for x in archs if x not in SMEM_OPTIN]
    if unknown:
        print(f"cuda_resource_audit: no shared-memory limits known for sm_{unknown}", file=sys.stderr)
        return 2
    cache = os.path.join(a.cache, f"nvcc-{release[0]}.{release[1]}",
                         inputs_hash(a.nvcc, a.ccbin, sources))
    os.makedirs(cache, exist_ok=True)
    jobs = [(s, arch) for arch in archs for s in sources]
    try:
        with ThreadPoolExecutor(max(1, a.jobs)) as ex:
            done = list(ex.map(lambda j: compile_one(a.nvcc, a.ccbin, j[0], j[1], cache), jobs))
        with_dbn = any(os.path.basename(s) == "dbn_cuda.cu" for s in sources)
        plan = smem_plan(os.path.join(a.cache, "probe-" + os.path.basename(cache))) if with_dbn else None
        allow = read_allowlist(a.allowlist)
    except RuntimeError as e:
        print(f"cuda_resource_audit: {e}", file=sys.stderr)
        return 2
    rows, failures = audit(dict(zip(jobs, done)), archs, plan, sources, allow)
    computed = {}
    if plan:
        computed = eig_limits(rows, plan, archs)
        failures += check_eig_limits(computed, stated_eig_limits())
    print(f"cuda_resource_audit: nvcc {release[0]}.{release[1]}, architectures "
          f"{', '.join('sm_%d' % x for x in archs)}, {len(sources)} sources, "
          f"{len({r['kernel'] for r in rows})} kernels")
    print(summary(rows, archs))
    if computed:
        print("shared-memory eigensolver, largest D: " +
              ", ".join(f"sm_{k} {v}" for k, v in sorted(computed.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"release": list(release), "archs": archs, "rows": rows,
                       "eig_limits": computed, "failures": failures}, f, indent=1)
    for msg in failures:
        print("FAIL: " + msg)
    print("cuda_resource_audit: " + ("OK" if not failures else f"{len(failures)} failure(s)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
