"""GluonCV 0.10.5 models with gn_mx (issue 40: docs/guide/gluoncv.md and its table): each model of
tests/gluoncv_worker.py's list is built with GroupNorm (norm_layer= or one replace_norm call: SSD
and FPN Faster R-CNN have SymbolBlock backbones), trained one step on synthetic data with GluonCV's
losses and target generators, exported with no BatchNorm left, and reloaded in a fresh process
without GluonCV, with the same output.

GluonCV is installed the way the guide says (``pip install gluoncv==0.10.5.post0 --no-deps`` and
``portalocker``; a plain install would upgrade numpy to 2.x), into a folder beside the test venv
(``<venv>/gnmx-gluoncv-0.10.5.post0``, made once and reused), put on the worker's PYTHONPATH only:
the test venv itself stays without GluonCV. No pip or no network: the tests skip, saying so.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT as _ROOT, run_python

GLUONCV = "gluoncv==0.10.5.post0"
SITE = Path(sys.prefix) / "gnmx-gluoncv-0.10.5.post0"
ROOT = Path(_ROOT)
WORKER = Path(__file__).with_name("gluoncv_worker.py")
#: model -> gn_group_norm nodes of its export (every BatchNorm of the model replaced)
EXPECTED = {
    "resnet18_v1b": 20,
    "yolo3_mobilenet1.0_coco": 47,
    "fcn_resnet50_ade": 57,
    "faster_rcnn_resnet50_v1b_coco": 53,
    "ssd_512_resnet50_v1_coco": 61,
    "faster_rcnn_fpn_resnet50_v1b_coco": 53,
}


@pytest.fixture(scope="module")
def gluoncv_site():
    if not (SITE / "gluoncv").is_dir():
        tmp = SITE.with_name(SITE.name + f".tmp{os.getpid()}")
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", "--no-deps", "--target", str(tmp),
                            GLUONCV, "portalocker"], capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            pytest.skip(f"pip could not install {GLUONCV}: {p.stderr.strip()[-300:]}")
        if not SITE.exists():  # (another run may have made it meanwhile)
            os.replace(tmp, SITE)
    return SITE


@pytest.fixture(scope="module")
def results(gluoncv_site, tmp_path_factory):
    """{model: (its row from the worker, the fresh-process reload's verdict)}: every model in one
    worker process, every reload in one fresh process (imports are most of the cost)."""
    out = tmp_path_factory.mktemp("gluoncv")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(gluoncv_site), str(ROOT / "tests")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # as run_python's reload
    p = subprocess.run([sys.executable, str(WORKER), str(out)] + sorted(EXPECTED),
                       capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    rows = {r["model"]: r for r in map(json.loads, p.stdout.strip().splitlines()) if "model" in r}
    assert p.returncode == 0 and rows, p.stdout[-2000:] + p.stderr[-4000:]
    r = run_python(_RELOAD.format(out=str(out), models=sorted(rows)), timeout=600)
    verdicts = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return {m: (rows.get(m), verdicts.get(m)) for m in EXPECTED}


# Reload each exported model without GluonCV on the path and compare with the worker's outputs:
# all of them for single-output models; for a detector (features.json: its backbone outputs'
# names), the backbone outputs by value and the detections by shape (see the worker's
# _save_backbone). Prints "MODEL OK" or "MODEL FAIL: why" per model.
_RELOAD = """
import json, os, traceback
import numpy as np, mxnet as mx
import gn_mx

def outputs(d, internals):
    sym = mx.sym.load(os.path.join(d, 'model-symbol.json'))
    if internals is not None:
        sym = mx.sym.Group([sym.get_internals()[n] for n in internals])
    blk = mx.gluon.SymbolBlock(sym, mx.sym.var('data'))
    blk.collect_params().load(os.path.join(d, 'model-0000.params'), ignore_extra=True)
    y = blk(mx.nd.array(np.load(os.path.join(d, 'x.npy'))))
    return [a.asnumpy() for a in ([y] if isinstance(y, mx.nd.NDArray) else y)]

def check(d, internals, saved, by_value):
    got, want = outputs(d, internals), np.load(os.path.join(d, saved))
    assert len(got) == len(want.files), (len(got), want.files)
    for i, a in enumerate(got):
        w = want['arr_%d' % i]
        assert a.shape == w.shape, (i, a.shape, w.shape)
        err = np.abs(a - w).max()
        assert not by_value or err <= 1e-5 * max(1.0, np.abs(w).max()), (saved, i, err)

for m in {models!r}:
    d = os.path.join({out!r}, m)
    try:
        feats = os.path.join(d, 'features.json')
        detector = os.path.exists(feats)
        check(d, None, 'y.npz', not detector)
        if detector:
            check(d, json.load(open(feats)), 'features.npz', True)
        print(m, 'OK', flush=True)
    except Exception:
        print(m, 'FAIL: ' + traceback.format_exc().strip().splitlines()[-1], flush=True)
"""


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_model_trains_exports_reloads(results, model):
    row, reload = results[model]
    print(json.dumps(row))
    assert row is not None and "error" not in row, row
    assert row["batch_norm"] == 0 and row["gn_group_norm"] == EXPECTED[model], row
    if row["how"] == "replace_norm":
        assert row["report"] == f"gn_mx.replace_norm: {EXPECTED[model]} replaced, 0 left in place"
    assert all(np.isfinite(row["losses"])) and row["losses"][0] != row["losses"][1], row
    assert reload == "OK", reload


def test_guide_table_lists_the_tested_models():
    text = (ROOT / "docs" / "guide" / "gluoncv.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M)
    assert sorted(rows) == sorted(EXPECTED), rows


def test_example_trains_a_groupnorm_detector(gluoncv_site, tmp_path):
    """examples/train_gn_detector.py, two steps: converts, trains, exports with no BatchNorm and
    reloads to the same top box."""
    env = dict(os.environ, PYTHONPATH=str(gluoncv_site), OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gn_detector.py"),
                        "--steps", "2", "--out", str(tmp_path / "ssd")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = p.stdout
    assert "gn_mx.replace_norm: 61 replaced, 0 left in place" in out, out
    assert ": 0 BatchNorm nodes;" in out, out
    top = re.search(r"top detection (\[[^\]]*\]).*reloaded: (\[[^\]]*\])", out)
    assert top and top.group(1) == top.group(2), out
