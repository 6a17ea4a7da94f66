"""GluonCV models with gn_mx, one per call (run by tests/test_gluoncv.py in a process that sees
GluonCV; docs/guide/gluoncv.md's table): build (pretrained=False, pretrained_base=False: nothing is
downloaded), put GroupNorm in (``norm_layer=`` or ``gn_mx.replace_norm``), train one SGD step on
synthetic data with GluonCV's own losses and target generators, export, and save the input and
the inference output for a fresh-process reload.

``python tests/gluoncv_worker.py OUT_DIR MODEL...`` prints one JSON line per model (its files in
OUT_DIR/MODEL): the model, how GroupNorm got in, the replace_norm report's first line, the
BatchNorm / gn_group_norm node counts of the exported symbol, the loss before and after the step
and the seconds taken.
"""
import json
import os
import sys
import time
import traceback

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx

# GluonCV 0.10.5 refuses to import beside torch >= 2; this process needs no torch: hide it.
sys.modules["torch"] = None
import gluoncv  # noqa: E402
from gluoncv import model_zoo  # noqa: E402
from gluoncv.loss import MixSoftmaxCrossEntropyLoss, SSDMultiBoxLoss  # noqa: E402
from gluoncv.model_zoo.rcnn.rpn.rpn_target import RPNTargetGenerator  # noqa: E402
from gluoncv.model_zoo.ssd.target import SSDTargetGenerator  # noqa: E402
from gluoncv.model_zoo.yolo.yolo_target import YOLOV3PrefetchTargetGenerator  # noqa: E402

SIZE = 128  # input height = width: tiny, the CI cost is the point
BOXES = mx.nd.array([[[8.0, 12.0, 80.0, 100.0], [40.0, 20.0, 120.0, 60.0]]])  # (1, M, 4), pixels
LABELS = mx.nd.array([[[1.0], [0.0]]])  # (1, M, 1) class ids


def _classification(net, x):
    return gluon.loss.SoftmaxCrossEntropyLoss()(net(x), mx.nd.array([1]))


def _segmentation(net, x):
    label = mx.nd.array(np.random.RandomState(0).randint(0, 2, (1, SIZE, SIZE)))
    return MixSoftmaxCrossEntropyLoss(aux=True)(*net(x), label)


def _ssd(net, x):
    cls_preds, box_preds, anchors = net(x)
    with autograd.pause():
        cls_t, box_t, _ = SSDTargetGenerator()(anchors, cls_preds, BOXES / SIZE, LABELS)
    losses = SSDMultiBoxLoss()(cls_preds, box_preds, cls_t, box_t)
    return losses[0][0]


def _yolo(net, x):
    net.hybridize()  # (re-trace at each change of arguments: GluonCV's YOLOv3 takes 1 or 7)
    with autograd.pause(train_mode=True):  # anchors, offsets, feature maps for the targets
        _, anchors, offsets, feat_maps = net(x)[:4]
        targets = YOLOV3PrefetchTargetGenerator(num_class=len(net.classes))(
            x, feat_maps, anchors, offsets, BOXES, LABELS, None)
    net.hybridize()
    return sum(net(x, BOXES, *targets))


def _rcnn(net, x):
    (cls_pred, box_pred, _, _, _, rpn_score, rpn_box, anchors, cls_t, box_t, box_m,
     _) = net(x, BOXES, LABELS)[:12]
    anchors = anchors if isinstance(anchors, (list, tuple)) else [anchors]  # FPN: one per level
    with autograd.pause():
        rpn_cls_t, rpn_box_t, rpn_box_m = RPNTargetGenerator(num_sample=64)(
            BOXES[0], mx.nd.concat(*[a.reshape((-1, 4)) for a in anchors], dim=0), SIZE, SIZE)
        rpn_cls_t, rpn_box_t, rpn_box_m = (mx.nd.array(a) for a in (rpn_cls_t, rpn_box_t,
                                                                    rpn_box_m))  # numpy
    rpn_mask = rpn_cls_t >= 0
    bce = gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=False)
    loss = bce(rpn_score.reshape((-1,)), rpn_cls_t, rpn_mask).sum() / rpn_mask.sum()
    loss = loss + (mx.nd.abs(rpn_box.reshape((-1, 4)) - rpn_box_t) * rpn_box_m).sum() / 64
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    loss = loss + ce(cls_pred.reshape((-1, cls_pred.shape[-1])), cls_t.reshape((-1,))).mean()
    return loss + (mx.nd.abs(box_pred - box_t) * box_m).mean()


#: model name -> (how GroupNorm gets in, loss function of the training step)
MODELS = {
    "resnet18_v1b": ("norm_layer", _classification),
    "yolo3_mobilenet1.0_coco": ("replace_norm", _yolo),
    "fcn_resnet50_ade": ("replace_norm", _segmentation),
    "ssd_512_resnet50_v1_coco": ("replace_norm", _ssd),
    "faster_rcnn_resnet50_v1b_coco": ("replace_norm", _rcnn),
    "faster_rcnn_fpn_resnet50_v1b_coco": ("replace_norm", _rcnn),
}


def _small_rcnn(net):
    """Proposal and RoI counts for a tiny image: the defaults exceed its anchors; 128 RoIs
    through a C4 model's last ResNet stage are most of its cost (FPN: its own counts are kept,
    fewer gave RoI features of 1e25)."""
    net.rpn._train_pre_nms = net.rpn._test_pre_nms = 900
    net.rpn._test_post_nms = net._rpn_test_post_nms = 32
    net.rpn._train_post_nms = 512
    if net.top_features is not None:
        net.rpn._train_post_nms = net.sampler._num_proposal = 128
        net._num_sample = net.sampler._num_sample = 16
        net.sampler._max_pos = net.target_generator._max_pos = 4
        net.target_generator._box_encoder._max_pos = 4


def build(name):
    """The model with GroupNorm in (num_groups=32 everywhere) and the replace_norm report line."""
    how, _ = MODELS[name]
    kw = {"pretrained": False}
    if how == "norm_layer":
        kw.update(norm_layer=gn_mx.GroupNorm, norm_kwargs={"num_groups": 32})
    else:
        kw["pretrained_base"] = False
    if name.startswith("fcn"):
        kw.update(crop_size=SIZE, base_size=SIZE)
    net = model_zoo.get_model(name, **kw)
    report = "(norm_layer=gn_mx.GroupNorm)"
    if how == "replace_norm":
        net = gn_mx.replace_norm(net)
        report = str(net.gn_mx_report).splitlines()[0]
    if hasattr(net, "rpn"):
        _small_rcnn(net)
    for pname, p in net.collect_params().items():  # a SymbolBlock's parameters have no init
        if p.init is None and pname.endswith(("gamma", "beta", "bias")):
            p.init = mx.init.One() if pname.endswith("gamma") else mx.init.Zero()
    net.initialize(mx.init.Xavier(magnitude=0.5))
    return net, report


def train_step(net, name, x):
    """One SGD step on the synthetic batch; the loss before and after it."""
    loss_fn = MODELS[name][1]
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-3})
    losses = []
    for step in range(2):
        with autograd.record():
            loss = loss_fn(net, x)
        losses.append(float(loss.mean().asscalar()))
        if step == 0:
            loss.backward()
            trainer.step(1)
    return losses


def _save_backbone(net, x, out_dir):
    """The detector's backbone outputs for x and their names in the exported graph: the
    detectors' outputs are not reproducible run to run at this size (GluonCV's own BatchNorm
    model, without gn_mx, gives other boxes at a second identical call: near-tied scores of an
    untrained head through NMS), so the reload is compared on the backbone, where every norm is."""
    feats = net.features(x)
    feats = [feats] if isinstance(feats, mx.nd.NDArray) else list(feats)
    names = mx.sym.Group(list(net.features(mx.sym.var("data")))).list_outputs()
    np.savez(f"{out_dir}/features.npz", *[a.asnumpy() for a in feats])
    json.dump(names, open(f"{out_dir}/features.json", "w"))


def run(name, out_dir):
    """One model: its table row (a dict); the export, input and outputs go into out_dir."""
    t0 = time.time()
    mx.random.seed(0)
    net, report = build(name)
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(1).rand(1, 3, SIZE, SIZE) * 2 - 1)
    losses = train_step(net, name, x)
    net.hybridize()  # re-trace: inference takes other arguments than R-CNN training
    y = net(x)
    y = [y] if isinstance(y, mx.nd.NDArray) else list(y)
    if len(y) == 3 and hasattr(net, "features"):  # a two-part detector; see _save_backbone
        _save_backbone(net, x, out_dir)
    prefix = f"{out_dir}/model"
    net.export(prefix)
    ops = [n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]]
    np.save(f"{out_dir}/x.npy", x.asnumpy())
    np.savez(f"{out_dir}/y.npz", *[a.asnumpy() for a in y])
    return {"model": name, "how": MODELS[name][0], "report": report,
            "batch_norm": sum(op.endswith("BatchNorm") for op in ops),
            "gn_group_norm": ops.count("gn_group_norm"), "losses": losses,
            "seconds": round(time.time() - t0, 1), "gluoncv": gluoncv.__version__}


def main(out_dir, names):
    """Every model in one process (the imports are most of a model's cost): one JSON line each,
    with "error" (the traceback's last lines) for a model that failed."""
    for name in names:
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        try:
            row = run(name, d)
        except Exception:  # noqa: BLE001 (reported in the row; the other models still run)
            row = {"model": name, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
