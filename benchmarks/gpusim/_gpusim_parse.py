"""Reading GPGPU-Sim's timing-mode output (bench_gpusim.py): per-kernel cycles, DRAM traffic and
blocks per SM between the worker's markers, and the table made from them.

What the simulator prints, per kernel: `pushing kernel '<name>' ... gridDim= (x,y,z) blockDim =
(x,y,z)` at launch; `CTA/core = K, limited by: regs` when a kernel's resources change; at its end
`kernel_name = ...`, `gpu_sim_cycle = C`, and the DRAM counters `total dram reads = R` / `total dram
writes = W`, which count 32-byte accesses CUMULATIVELY over the process (differences are taken), and
the warp-slot counters `Stall:a W0_Idle:b W0_Scoreboard:c` (also cumulative).
"""
import ctypes
import json
import re

MARK = "@@gpusim"
SECTOR = 32          # bytes per DRAM access counted by the simulator (sectored V100 memory)
CLOCK_MHZ = 1132.0   # SM7_QV100 core clock
SMS = 80

_libc = ctypes.CDLL(None)


def flush_c_stdout():
    """Flushes C stdio (the simulator's printf) so its lines reach the file descriptor now."""
    _libc.fflush(None)


_PUSH = re.compile(r"pushing kernel '(\S+)'.*gridDim= \((\d+),(\d+),(\d+)\)")
_CTA = re.compile(r"CTA/core = (\d+), limited by:(.*)")
_VAL = re.compile(r"^(kernel_name|gpu_sim_cycle|gpu_sim_insn|total dram reads|total dram writes)"
                  r" = (\S+)")
# warp-slot states summed over the SMs' schedulers, cumulative: Stall (pipeline), W0_Idle (no warp
# to issue: too few warps / blocks), W0_Scoreboard (warps waiting on results: latency)
_WARPS = re.compile(r"^Stall:(\d+)\s+W0_Idle:(\d+)\s+W0_Scoreboard:(\d+)")


def short_name(mangled):
    """`stats_kernel` from `_ZN5gn_mx12_GLOBAL__N_112stats_kernelIfEEv...`: a length-prefixed
    identifier ending in `kernel` (the length may follow other digits: `_N_1` + `12`), else the
    input."""
    for m in re.finditer(r"(?=(\d{1,3}))", mangled):
        digits = m.group(1)
        for cut in range(len(digits)):  # "112" may be "1" + "12": try each suffix of the run
            n, start = int(digits[cut:]), m.start() + len(digits)
            ident = mangled[start:start + n]
            if (len(ident) == n and ident.endswith("kernel")
                    and re.fullmatch(r"[A-Za-z_]\w*", ident)):
                return ident
    return mangled


class Stream:
    """Line-by-line state: kernels of the current (row, part) between markers, DRAM totals."""

    def __init__(self):
        self.rows = {}        # row -> {"op": [kernel dicts], "ref": [...]}
        self.part = None      # (row, "op" | "ref") between a begin and its end marker
        self.dram = [0, 0]    # cumulative (reads, writes) at the last kernel end
        self.warps = [0, 0, 0]  # cumulative (Stall, W0_Idle, W0_Scoreboard)
        self.cta = None       # the last CTA/core line: (blocks, limiter)
        self.grid = {}        # kernel name -> blocks of its launches not yet reported (FIFO: the
        #                       simulator may push the next launch before the last one's stats)
        self.cur = None

    def feed(self, line):
        """Consumes one line; returns a row's name when its last part (ref) has ended."""
        line = line.strip()
        if line.startswith(MARK):
            return self._marker(line[len(MARK):].split())
        m = _PUSH.search(line)
        if m:
            blocks = int(m.group(2)) * int(m.group(3)) * int(m.group(4))
            self.grid.setdefault(m.group(1), []).append(blocks)
            return None
        m = _CTA.search(line)
        if m:
            self.cta = (int(m.group(1)), m.group(2).strip())
            return None
        m = _VAL.match(line)
        if m:
            self._value(m.group(1), m.group(2))
        m = _WARPS.match(line)
        if m and self.cur is not None:
            now = [int(v) for v in m.groups()]
            for key, a, b in zip(("stall", "idle", "scoreboard"), now, self.warps):
                self.cur["warp_" + key] = a - b
            self.warps = now
        return None

    def _marker(self, words):
        if words[0] == "info":
            self.rows.setdefault(words[1], {"op": [], "ref": []})["info"] = json.loads(words[2])
        elif words[0] == "begin":
            self.part = (words[1], words[2])
            self.rows.setdefault(words[1], {"op": [], "ref": []})
        elif words[0] == "end":
            self.part = None
            if words[2] == "ref":
                return words[1]
        return None

    def _value(self, key, val):
        if key == "kernel_name":
            self.cur = {"kernel": short_name(val), "mangled": val,
                        "blocks": self.grid[val].pop(0) if self.grid.get(val) else 0,
                        "cta_per_sm_limit": self.cta[0] if self.cta else None,
                        "limited_by": self.cta[1] if self.cta else None}
            if self.part:
                self.rows[self.part[0]][self.part[1]].append(self.cur)
        elif key == "gpu_sim_cycle" and self.cur is not None:
            self.cur["cycles"] = int(val)
        elif key == "gpu_sim_insn" and self.cur is not None:
            self.cur["thread_insn"] = int(val)
        elif key in ("total dram reads", "total dram writes") and self.cur is not None:
            i = 0 if key.endswith("reads") else 1
            self.cur["dram_" + ("read" if i == 0 else "write") + "_bytes"] = \
                (int(val) - self.dram[i]) * SECTOR
            self.dram[i] = int(val)


def _totals(kernels):
    cyc = sum(k.get("cycles", 0) for k in kernels)
    rd = sum(k.get("dram_read_bytes", 0) for k in kernels)
    wr = sum(k.get("dram_write_bytes", 0) for k in kernels)
    return cyc, rd, wr


def blocks_per_sm(k):
    """Achieved blocks per SM: the grid spread over 80 SMs, capped by the resource limit."""
    if not k.get("blocks"):
        return None
    per = -(-k["blocks"] // SMS)
    lim = k.get("cta_per_sm_limit")
    return min(per, lim) if lim else per


def row_result(row, parts):
    """The stored result of one row: its kernels, totals and the ratio to its yardstick."""
    op, ref = parts["op"], parts["ref"]
    cyc, rd, wr = _totals(op)
    rcyc, rrd, rwr = _totals(ref)
    min_bytes = parts.get("info", {}).get("min_bytes")
    res = {"label": row["label"], "kind": row["kind"], "min_bytes": min_bytes,
           "flops": row.get("flops"), "cycles": cyc, "dram_read_bytes": rd,
           "dram_write_bytes": wr, "ref_cycles": rcyc, "ref_dram_bytes": rrd + rwr,
           "kernels": [{k: v for k, v in kk.items() if k != "mangled"} for kk in op]}
    for kk in res["kernels"]:
        kk["blocks_per_sm"] = blocks_per_sm(kk)
    for key in ("warp_idle", "warp_scoreboard", "warp_stall", "thread_insn"):
        res[key] = sum(k.get(key, 0) for k in op)
    if row["kind"] == "copy":
        res["ratio"] = rcyc / cyc if cyc else None  # same bytes: time ratio = bandwidth ratio
    else:
        peak = row["ref_flops"] / rcyc if rcyc else None  # flops per cycle of the FMA kernel
        res["peak_flops_per_cycle"] = peak
        res["ratio"] = (row["flops"] / cyc) / peak if cyc and peak else None
    res["traffic_vs_min"] = (rd + wr) / min_bytes if min_bytes else None
    res["us"] = cyc / CLOCK_MHZ
    return res


def summary(r):
    return (f"{r['cycles']} cycles, ratio {r['ratio']:.2f}" if r.get("ratio") is not None
            else f"{r['cycles']} cycles")


def _fmt_warps(r):
    """Shares of the op's empty issue slots: no warp at all (idle) / warps waiting on results
    (scoreboard) / pipeline stalls."""
    tot = r.get("warp_idle", 0) + r.get("warp_scoreboard", 0) + r.get("warp_stall", 0)
    if not tot:
        return ""
    keys = ("warp_idle", "warp_scoreboard", "warp_stall")
    return "/".join(f"{100 * r[k] / tot:.0f}" for k in keys)


def _fmt_kernels(r):
    return "; ".join(f"{k['kernel']} {k.get('cycles', '?')} ({k.get('blocks', '?')} blk, "
                     f"{k.get('blocks_per_sm', '?')}/SM)" for k in r["kernels"])


def _fmt_commits(results):
    """'Commit X', or, where rows were re-run after a kernel change (a resumed run keeps the rows
    it already has), each commit with its rows: every row times the kernels of its own commit."""
    m = results.get("meta", {})
    by = {}
    for name, r in results["rows"].items():
        by.setdefault(r.get("git", m.get("git", "?")), []).append(name)
    if len(by) <= 1:
        return f"Commit {next(iter(by), m.get('git', '?'))}"
    return "Kernels of commits " + "; ".join(f"{c} ({', '.join(n)})" for c, n in by.items())


def markdown(results, rows, bounds):
    """The results table (rows in the order of _gpusim_rows.ROWS)."""
    m = results.get("meta", {})
    out = ["# gn_mx on a simulated V100 (GPGPU-Sim timing model), not a measurement on hardware",
           "", f"Simulator: {m.get('simulator', '?')}. PTX: {m.get('ptx', '?')}. "
           f"{_fmt_commits(results)}. Made by `{m.get('command', '?')}`.", "",
           "ratio: memory-bound rows = copy cycles / op cycles, the copy (float4 grid-stride, "
           "8 x 256-thread blocks per SM) moving the op's minimum bytes (reads + writes) in the "
           "same process (1.0 = copy speed); DBN / IterNorm = (useful FLOPs / op cycles) / the "
           "simulated fp32 FMA kernel's FLOPs per cycle (their m x D products are fp32 FMAs; "
           "the D x D math is fp64). "
           "DRAM x min: bytes the op moved to/from DRAM / its minimum (< 1: L2 kept written data). "
           "Empty issue slots (summed over the schedulers): idle = no warp resident (too few "
           "blocks/warps), scoreboard = warps waiting on a result (latency), stall = pipeline. "
           "process: own = the row alone in its simulator process (cold caches and counters); "
           "shared = measured after other rows in one process (before runs were per row), which "
           "moved op and copy by up to 30%.",
           "", "| row | case | op cycles | us @1132 MHz | yardstick cycles | ratio | DRAM x min | "
           "empty slots % idle/scoreboard/stall | kernels: cycles (blocks, blocks/SM) | process |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name in rows:
        r = results["rows"].get(name)
        if r is None:
            out.append(f"| {name} | {rows[name]['label']} | not run | | | | | | | |")
            continue
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        tvm = "" if r.get("traffic_vs_min") is None else f"{r['traffic_vs_min']:.2f}"
        out.append(f"| {name} | {r['label']} | {r['cycles']} | {r['us']:.1f} | {r['ref_cycles']} "
                   f"| {ratio} | {tvm} | {_fmt_warps(r)} | {_fmt_kernels(r)} "
                   f"| {r.get('process', 'shared').split(' ')[0]} |")
    notes = [f"- {n}: {b}" for n, b in bounds.items()]
    if notes:
        out += ["", "Bounds named per row (from the simulator's counters):", ""] + notes
    return "\n".join(out) + "\n"
