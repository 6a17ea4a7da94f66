"""gn_mx's CUDA kernels timed on a simulated V100 (GPGPU-Sim's timing model, SM7_QV100), each row
next to a yardstick run in the same process: a float4 grid-stride copy of the op's minimum bytes
(memory-bound rows) or the simulated FMA peak (DBN / IterNorm). SIMULATED, not measured on hardware.

    GNMX_GPGPUSIM_SRC=<simulator source> python benchmarks/gpusim/bench_gpusim.py [--rows a,b]
        [--out benchmarks/results] [--fresh] [--rerun a,b] [--list]

Each row runs in its own simulator process (which first parses the ~13 MB of PTX: 30-90 s), ONE
process at a time under `nice -n 5`, through tests/gpu/sim/gpgpusim.sh in timing mode
(GNMX_GPGPUSIM_TIMING=1: -gpgpu_ptx_sim_mode 0 + PTX_SIM_MODE_FUNC=0, no launch latency, host copies
not simulated). Its own process: rows that ran before another in one process left its caches,
DRAM row buffers and counters in another state and moved both its op and its copy by up to 30%
(docs/performance/gpu.md); `process` in each stored row says how it ran. Every finished row is
written at once to <out>/gpusim_v100.json; a rerun skips the rows already there (resumable; --fresh
starts over; --rerun a,b measures those rows again, each old row kept until its new one is done)
and rewrites <out>/gpusim_v100.md; each row records the commit whose kernels it timed. The
simulator's output of a row is build/gpusim/<row>.log.
Each op runs once, cold (inputs copied from the host bypass L2); the copy reads a fresh buffer.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _gpusim_rows as rows_mod  # noqa: E402
import _gpusim_parse as parse  # noqa: E402

SIM = os.path.join(ROOT, "tests", "gpu", "sim", "gpgpusim.sh")
RESULT = "gpusim_v100"
LOGS = os.path.join(ROOT, "build", "gpusim")  # the simulator's output per row (git-ignored)
OWN = "own"  # `process` of a row run alone in its simulator process
SHARED = "shared (after other rows of its group)"  # rows stored before runs were per row


# ---- worker: runs inside the simulator process ---------------------------------------------------

def marker(text):
    """One marker line on stdout, after everything the simulator printed so far (C stdio)."""
    parse.flush_c_stdout()
    os.write(1, f"\n{parse.MARK} {text}\n".encode())


def worker(names):
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import harness_np as hnp
    lib = hnp.load()
    for name in names:
        row = rows_mod.ROWS[name]
        op, ref, info = row["make"](hnp, lib)
        marker(f"info {name} {json.dumps(info, separators=(',', ':'))}")
        marker(f"begin {name} op")
        op()
        marker(f"end {name} op")
        marker(f"begin {name} ref")
        ref()
        marker(f"end {name} ref")
    marker("done")


# ---- driver --------------------------------------------------------------------------------

def load_results(path, fresh):
    if fresh or not os.path.exists(path):
        return {"meta": {}, "rows": {}}
    with open(path) as f:
        return json.load(f)


def save(results, out):
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, RESULT + ".json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out, RESULT + ".json"))
    with open(os.path.join(out, RESULT + ".md"), "w") as f:
        f.write(parse.markdown(results, rows_mod.ROWS, rows_mod.BOUNDS))


def run_process(name, results, out):
    """One simulator process for the row `name`; the row is stored as soon as its markers close."""
    log_path = os.path.join(LOGS, f"{name}.log")
    env = dict(os.environ, GNMX_GPGPUSIM_TIMING="1", PYTHONUNBUFFERED="1")
    cmd = ["nice", "-n", "5", "bash", SIM, "run", sys.executable, os.path.abspath(__file__),
           "--worker", name]
    t0 = time.time()
    stream = parse.Stream()
    with open(log_path, "w") as log, subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace") as p:
        for line in p.stdout:
            log.write(line)
            done = stream.feed(line)
            if done:
                results["rows"][done] = parse.row_result(rows_mod.ROWS[done], stream.rows[done])
                results["rows"][done]["sim_wall_s"] = round(time.time() - t0, 1)
                results["rows"][done]["git"] = results["meta"].get("git", "?")
                results["rows"][done]["process"] = OWN
                save(results, out)
                print(f"[gpusim] {done}: {parse.summary(results['rows'][done])}", flush=True)
                t0 = time.time()
    if p.returncode != 0:
        raise SystemExit(f"simulator process failed ({p.returncode}); log: {log_path}")


def meta():
    nvcc = os.path.join(ROOT, ".toolchains", "cuda-11.8", "bin", "nvcc")
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    return {"simulator": "GPGPU-Sim 667834cf + tests/gpu/sim/gpgpusim-fixes.patch, SM7_QV100 "
                         "(80 SMs, 1132 MHz core), timing mode, launch latency 0, "
                         "perf_sim_memcpy 0",
            "ptx": "nvcc 11.8, compute_70 PTX (tests/gpu/sim/gpgpusim.sh harness)",
            "nvcc_found": os.path.exists(nvcc), "git": rev,
            "command": "GNMX_GPGPUSIM_SRC=... python benchmarks/gpusim/bench_gpusim.py "
                       "--out benchmarks/results",
            "note": "SIMULATED (GPGPU-Sim timing model), not a measurement on hardware"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated row names (default: all)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--fresh", action="store_true", help="forget finished rows")
    ap.add_argument("--rerun", help="comma-separated rows to measure again (after a kernel change), "
                                    "keeping the others; without --rows, only these run")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker.split(","))
    if a.list:
        for name, r in rows_mod.ROWS.items():
            print(f"{r['group']:8s} {name:22s} {r['label']}")
        return 0
    if not os.environ.get("GNMX_GPGPUSIM_SRC"):
        raise SystemExit("set GNMX_GPGPUSIM_SRC to the simulator source (tests/gpu/README.md)")
    rerun = a.rerun.split(",") if a.rerun else []
    wanted = a.rows.split(",") if a.rows else rerun or list(rows_mod.ROWS)
    unknown = [n for n in dict.fromkeys(wanted + rerun) if n not in rows_mod.ROWS]
    if unknown:
        raise SystemExit(f"unknown rows: {', '.join(unknown)} (--list shows them)")
    path = os.path.join(a.out, RESULT + ".json")
    results = load_results(path, a.fresh)
    for r in results["rows"].values():  # rows of an earlier run keep the commit they timed
        r.setdefault("git", results["meta"].get("git", "?"))
        r.setdefault("process", SHARED)
    results["meta"] = meta()
    todo = [n for n in wanted if n not in results["rows"] or n in rerun]
    os.makedirs(LOGS, exist_ok=True)
    for n in todo:
        print(f"[gpusim] {n}: own simulator process, log {os.path.join(LOGS, n + '.log')}",
              flush=True)
        run_process(n, results, a.out)
    save(results, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
