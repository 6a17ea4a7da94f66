"""Shared parent-side plumbing of the CPU benchmarks that time one child process per allocator
regime (bench_fused_act.py, bench_in_network.py, bench_convert.py, bench_inference.py): the glibc
"keep freed memory" environment, the common command-line options, the loop that runs the script's
own --child once per regime, and the writer of the STEM.md / STEM.json pair."""
import argparse
import json
import os
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# glibc told to keep freed memory: one arena, no mmap for big blocks, no trimming (fresh MXNet
# outputs then land in warm pages instead of being page-faulted in on every call).
KEPT = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def add_timing_args(ap, regimes, out_help=None, thread_list=False):
    """--threads/--quick/--regimes/--rounds/--min-sample-ms/--max-cell-s/--out/--child
    (``out_help``: --out's help, when the script reads it otherwise than as a directory;
    ``thread_list``: --threads takes comma-separated counts, a string the script splits)."""
    if thread_list:
        ap.add_argument("--threads", default="2", help="comma-separated thread counts, one child "
                        "process per count and regime (default: %(default)s)")
    else:
        ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--regimes", default=regimes)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--min-sample-ms", type=float, default=None)
    ap.add_argument("--max-cell-s", type=float, default=None)
    ap.add_argument("--out", default=None, metavar="DIR" if out_help is None else "PATH",
                    help=out_help or "write the result files into DIR (benchmarks/results holds the "
                                     "tracked ones); default: print only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def timing_defaults(args, quick, full):
    """Fills unset --rounds, --min-sample-ms, --max-cell-s from (rounds, ms, s) for --quick or not."""
    rounds, min_ms, max_s = quick if args.quick else full
    args.rounds = args.rounds or rounds
    args.min_sample_ms = args.min_sample_ms or min_ms
    args.max_cell_s = args.max_cell_s or max_s


def run_regimes(script, args, regimes, extra=()):
    """Runs `script --child` once per name in args.regimes, each in a fresh environment: every
    variable any regime sets is cleared, then the regime's own ({name: env}) and
    OMP_NUM_THREADS=args.threads are set. Returns {name: the child's JSON from stdout}."""
    managed = set().union(*regimes.values())
    runs = {}
    for name in args.regimes.split(","):
        env = {k: v for k, v in os.environ.items() if k not in managed}
        env.update(regimes[name])
        env["OMP_NUM_THREADS"] = str(args.threads)
        print("running %s ..." % name, file=sys.stderr)
        cmd = [sys.executable, os.path.abspath(script), "--child", "--rounds", str(args.rounds),
               "--min-sample-ms", str(args.min_sample_ms), "--max-cell-s", str(args.max_cell_s)]
        p = subprocess.run(cmd + list(extra), env=env, stdout=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.exit("child %s failed" % name)
        runs[name] = json.loads(p.stdout)
    return runs


def result_stem(out, default_name):
    """Where ``--out`` writes: an existing directory -> DIR/default_name; a bare name (no directory
    part) -> benchmarks/results/NAME; any other path -> that path. Without the extension."""
    if os.path.isdir(out):
        return os.path.join(out, default_name)
    if not os.path.dirname(out):
        return os.path.join(RESULTS, out)
    return out


def write_results(stem, title, about, text, data, tail=""):
    """Writes STEM.md ("# title", then "<UTC date> UTC; about", the report text and tail) and
    STEM.json ({"date_utc": <the same date>, **data}), creating STEM's directory."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    date = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(stem + ".md", "w") as f:
        f.write("# %s\n\n%s UTC; %s\n%s\n%s" % (title, date, about, text, tail))
    with open(stem + ".json", "w") as f:
        json.dump(dict({"date_utc": date}, **data), f, indent=1)
