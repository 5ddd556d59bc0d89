"""xla_utils.step.inputs: the samples users bring (torchvision CHW tensors, tv_tensors.Image,
numpy, PIL, ...) through fit / predict / evaluate / lr_find on real XLA:CPU, and the
samples the trainer refuses before any device time."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from helpers import pooled_cnn

from xla_utils import OneCycleTrainer, lr_find
from xla_utils.data import images_to_float
from xla_utils.step.inputs import HostFeed, InputRefused, inspect_inputs

N, SIZE, BS = 32, 8, 8
FORMATS = ("hwc", "chw", "tv", "float", "numpy", "pil")


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (N, SIZE, SIZE, 3), dtype=torch.uint8, generator=g)
    return x, torch.arange(N) % 2


def _samples(fmt: str) -> list:
    """The same N images (and labels) in the form ``fmt``."""
    x, y = _images()
    if fmt == "hwc":
        xs = list(x)
    elif fmt == "chw":
        xs = [i.permute(2, 0, 1).contiguous() for i in x]
    elif fmt == "tv":
        tv = pytest.importorskip("torchvision.tv_tensors")
        xs = [tv.Image(i.permute(2, 0, 1).contiguous()) for i in x]
    elif fmt == "float":  # already normalised on the host: passed to the model untouched
        xs = list(images_to_float(x))
    elif fmt == "numpy":
        xs = [i.numpy() for i in x]
    else:
        xs = [Image.fromarray(i.numpy()) for i in x]
    return [(a, int(b)) for a, b in zip(xs, y)]


def _trainer(fmt: str, **kw) -> OneCycleTrainer:
    torch.manual_seed(0)
    data = _samples(fmt)
    return OneCycleTrainer(pooled_cnn(), nn.CrossEntropyLoss(), data, data, batch_size=BS, epochs=1,
                           max_lr=1e-2, seed=1, log_every=1, num_workers=0, **kw)


def _numbers(fmt: str, simulate: int, ops: tuple[str, ...]) -> dict[str, np.ndarray]:
    """What each op gives for the images in form ``fmt``, on ``simulate`` XLA:CPU cores."""
    out: dict[str, np.ndarray] = {}
    t = _trainer(fmt)
    if "lr_find" in ops:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a 6-step sweep is too short for a suggestion
            res = t.find_lr(simulate=1, num_it=6, show_progress=False)
        out["lr_find"] = res.losses
    if "fit" in ops:
        h = t.fit(simulate=simulate)
        out["fit"] = np.array([h[0]["train_loss"], h[0]["val_loss"]])
    if "predict" in ops:
        out["predict"] = t.predict(_samples(fmt), simulate=simulate)
    if "evaluate" in ops:
        out["evaluate"] = np.array([t.evaluate(_samples(fmt), simulate=simulate)["loss"]])
    return out


ALL_OPS = ("lr_find", "fit", "predict", "evaluate")


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, np.ndarray]]:
    """uint8 HWC (the cache's layout) results, one core and two simulated cores."""
    return {1: _numbers("hwc", 1, ALL_OPS), 2: _numbers("hwc", 2, ("fit", "predict"))}


def _compare(fmt: str, got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    for op, value in got.items():
        assert np.all(np.isfinite(value)), (fmt, op, value)
        if fmt == "float" and op != "lr_find":
            continue  # host-normalised floats are not flipped in fit: another trained model
        tol = 1e-4 if fmt == "float" else 1e-6  # float: normalised on the host, not the device
        np.testing.assert_allclose(value, ref[op], rtol=tol, atol=tol, err_msg=f"{fmt} {op}")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "hwc"])
def test_every_input_form_gives_the_numbers_of_uint8_hwc_on_one_core(fmt, reference):
    _compare(fmt, _numbers(fmt, 1, ALL_OPS), reference[1])


@pytest.mark.multicore
@pytest.mark.parametrize("fmt", ("chw", "tv", "pil"))
def test_every_input_form_gives_the_numbers_of_uint8_hwc_on_simulated_cores(fmt, reference):
    _compare(fmt, _numbers(fmt, 2, ("fit", "predict")), reference[2])


# ----------------------------------------------------------------------------- refused


class _Bomb:
    """Device time would start with the launch: refusing must come first."""


def _refused(data, match: str, ops=ALL_OPS) -> None:
    t = OneCycleTrainer(pooled_cnn(), nn.CrossEntropyLoss(), data, batch_size=BS, epochs=1)
    calls = {"fit": lambda: t.fit(simulate=1), "predict": lambda: t.predict(data, simulate=1),
             "evaluate": lambda: t.evaluate(data, simulate=1),
             "lr_find": lambda: t.find_lr(simulate=1, num_it=3)}
    for op in ops:
        with pytest.raises(TypeError, match=match):
            calls[op]()


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything reaches the launcher (device time)."""
    from xla_utils import runtime

    def launched(*a, **k):
        raise AssertionError("a launch started: the input was not refused before device time")

    monkeypatch.setattr(runtime, "launch_job", launched)


@pytest.mark.parametrize("sample, match", [
    (("a string", 1), r"input is a str \('a string'\).*cannot feed.*PILToTensor"),
    ((np.array([object(), object()]), 1), r"numpy.ndarray of shape \(2,\) and dtype object"),
    ((torch.zeros(5, 7, 9, dtype=torch.uint8), 1),
     r"torch.Tensor of shape \(5, 7, 9\) and dtype uint8.*no channel axis"),
    ((torch.zeros(2, 8, 8, 3, dtype=torch.uint8), 1), r"shape \(2, 8, 8, 3\) and dtype uint8"),
    ({"pixels": torch.zeros(3, 8, 8), "cls": 1}, r"dict with keys \['cls', 'pixels'\].*'image'"),
    ((torch.zeros(3, 8, 8), "cat"), r"target is a str \('cat'\).*classes.index"),
    ((None, 1), r"input is a NoneType"),
])
def test_samples_the_trainer_cannot_feed_are_named_before_device_time(sample, match, no_launch):
    _refused([sample] * N, match)


def test_refusals_in_check_and_debug_come_before_device_time(no_launch):
    t = OneCycleTrainer(pooled_cnn(), nn.CrossEntropyLoss(), [("text", 1)] * N, batch_size=BS)
    for call in (t.check, t.debug, lambda: lr_find(pooled_cnn(), nn.CrossEntropyLoss(),
                                                   [("text", 1)] * N, BS, simulate=1)):
        with pytest.raises(InputRefused, match="input is a str"):
            call()


def test_a_sample_without_target_is_refused_where_targets_are_needed(no_launch):
    data = [torch.zeros(3, 8, 8)] * N
    _refused(data, r"item 0 is a torch.Tensor of shape \(3, 8, 8\).*not an \(input, target\) "
             r"pair: training needs targets", ops=("fit",))
    _refused(data, "evaluate needs targets", ops=("evaluate",))


def test_channels_that_do_not_match_mean_are_refused_with_the_fix(no_launch):
    grey = [(torch.zeros(1, 8, 8, dtype=torch.uint8), 0)] * N
    t = OneCycleTrainer(pooled_cnn(), nn.CrossEntropyLoss(), grey, batch_size=BS)
    with pytest.raises(ValueError, match=r"1-channel images.*mean/std have 3 values.*"
                                         r"mean=\(0.5,\), std=\(0.5,\)"):
        t.fit(simulate=1)
    assert inspect_inputs(grey, "x", mean=(0.5,)).channels == 1


# ----------------------------------------------------------------------------- the layout rule


def test_the_layout_of_an_ambiguous_shape_follows_the_sample_type():
    # [3, 32, 3]: a 3-pixel-wide CHW image or a 3-pixel-high HWC one (xla_utils.data.image_layout)
    # torch tensors follow torchvision (CHW), numpy arrays PIL/OpenCV (HWC)
    t = inspect_inputs([(torch.zeros(3, 32, 3, dtype=torch.uint8), 0)], "d")
    a = inspect_inputs([(np.zeros((3, 32, 3), np.uint8), 0)], "d")
    assert (t.layout, t.ambiguous, a.layout, a.ambiguous) == \
        ("channels_first", True, "channels_last", True)
    assert (t.image_chw, a.image_chw) == ((3, 32, 3), (3, 3, 32))
    assert "ambiguous shape" in t.describe(flip=True) and "torch tensors" in t.describe(flip=True)
    assert "numpy arrays" in a.describe(flip=True)
    assert not inspect_inputs([(torch.zeros(3, 32, 32, dtype=torch.uint8), 0)], "d").ambiguous
    tv = pytest.importorskip("torchvision.tv_tensors")
    # tv_tensors.Image is [C, H, W] by definition, whatever its shape
    s = inspect_inputs([(tv.Image(torch.zeros(4, 8, 3, dtype=torch.uint8)), 0)], "d")
    assert (s.layout, s.ambiguous) == ("channels_first", False)


def test_pil_images_become_hwc_arrays_on_the_host():
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    data = [(Image.fromarray(rgb), 1), (Image.fromarray(rgb[:, :, 0]).convert("P"), 0),
            (Image.fromarray(rgb[:, :, 0]), 0)]
    spec = inspect_inputs(data, "d", mean=(0, 0, 0))
    fed = spec.feed(data)
    assert isinstance(fed, HostFeed) and spec.shape == (4, 5, 3) and spec.pil
    x, y = fed[0]
    assert x.dtype == np.uint8 and np.array_equal(x, rgb) and y == 1
    assert fed[1][0].shape == (4, 5, 3)  # palette -> RGB, as build_cache does
    assert fed[2][0].shape == (4, 5, 1)  # grey keeps its one channel
    assert "PIL.Image (mode RGB) converted on the host" in spec.describe(flip=False)
    with pytest.raises(InputRefused, match="mode I;16"):
        inspect_inputs([(Image.new("I;16", (4, 4)), 0)], "d")


def test_dict_samples_with_known_keys_become_pairs():
    data = [{"image": torch.zeros(3, 8, 8, dtype=torch.uint8), "label": 1, "id": "a"}] * 4
    spec = inspect_inputs(data, "d")
    assert spec.keys == ("image", "label") and spec.layout == "channels_first"
    x, y = spec.feed(data)[0]
    assert x.shape == (3, 8, 8) and y == 1


def test_check_and_debug_report_the_input_layout(capsys):
    t = _trainer("chw")
    rep = t.check(steps=3, measure_loader=False)
    assert rep.inputs == ("inputs: uint8 [B,3,8,8] channels-first images (torch.Tensor), "
                          "normalised and flipped on the device")
    assert rep.inputs in rep.report
    dbg = t.debug(steps=3)  # the trainer's own step: flips as fit does
    assert dbg.inputs == ("inputs: uint8 [B,3,8,8] channels-first images (torch.Tensor), "
                          "normalised and flipped on the device")
    assert dbg.inputs in dbg.report.splitlines()[1]
    pil = _trainer("pil").check(steps=3, measure_loader=False)
    assert "PIL.Image (mode RGB) converted on the host to uint8 [B,8,8,3] channels-last" \
        in pil.inputs
    flt = _trainer("float").debug(steps=3)
    assert flt.inputs == "inputs: float32 [B,3,8,8] (torch.Tensor), passed to the model unchanged"


def test_standalone_check_and_debug_run_decide_the_layout_as_the_trainer_does():
    import xla_utils
    from xla_utils import debug_run

    x, y = _images()
    chw = x.permute(0, 3, 1, 2).contiguous()
    rep = xla_utils.check(pooled_cnn(), (chw[:BS], y[:BS]), steps=3, verbose=False)
    assert rep.inputs == ("inputs: uint8 [B,3,8,8] channels-first images (torch.Tensor), "
                          "normalised on the device") and not rep.errors
    dbg = debug_run(pooled_cnn(), nn.CrossEntropyLoss(), _samples("pil"), batch_size=BS, steps=3,
                    print_report=False)
    assert "PIL.Image (mode RGB) converted on the host to uint8 [B,8,8,3]" in dbg.inputs
    assert len(dbg.losses) == 3 and all(np.isfinite(dbg.losses))


# ----------------------------------------------------------------------------- targets
def _plan(model, loss, data):
    from xla_utils.step.inputs import plan_targets

    spec = inspect_inputs(data, "train_data")
    return plan_targets(model, loss, data, spec, "train_data", lambda x: x, lambda m, b: m(b[0]))


def test_targets_plan_the_problem_and_feed_float_targets_of_the_output_shape():
    """Regression and one-logit binary targets are fed as float32 of the model output's
    shape; class indices and multi-hot rows as they are; mismatches refused with the fix."""
    from helpers import digits_tensors, tiny_mlp

    x, y = digits_tensors(64)
    ints = torch.utils.data.TensorDataset(x, y)
    floats = torch.utils.data.TensorDataset(x, y.double() + 0.5)  # float64 [N]: a scalar per sample
    spec, plan = _plan(tiny_mlp(1), nn.MSELoss(), floats)
    assert (plan.kind, plan.shape) == ("regression", (1,))
    batch = torch.utils.data.default_collate([spec.feed(floats)[i] for i in range(3)])
    assert batch[1].dtype == torch.float32 and batch[1].tolist() == [[0.5], [1.5], [2.5]]
    assert _plan(tiny_mlp(1), nn.L1Loss(), ints)[1].kind == "regression"  # counts: numbers too
    with pytest.raises(ValueError, match=r"1 regression target\(s\) per sample but the model outputs 10 "
                                         r"value\(s\).*build the model with 1 output"):
        _plan(tiny_mlp(10), nn.HuberLoss(), floats)
    binary = torch.utils.data.TensorDataset(x, (y == 3).long())
    spec, plan = _plan(tiny_mlp(1), nn.BCEWithLogitsLoss(), binary)
    assert (plan.kind, plan.shape) == ("binary", (1,))
    assert spec.feed(binary)[3][1].dtype == np.float32 and spec.feed(binary)[3][1].tolist() == [1.0]
    with pytest.raises(ValueError, match=r"label 2 at sample 2 is not 0 or 1.*one-logit binary.*"
                                         r"CrossEntropyLoss\(\) and a model with 10 outputs"):
        _plan(tiny_mlp(1), nn.BCEWithLogitsLoss(), ints)
    with pytest.raises(ValueError, match=r"label 1 at sample \d+ is outside the model's 1 outputs.*"
                                         r"loss=nn.BCEWithLogitsLoss\(\)"):
        _plan(tiny_mlp(1), nn.CrossEntropyLoss(), binary)
    assert _plan(tiny_mlp(10), nn.CrossEntropyLoss(), ints)[1] == \
        type(_plan(tiny_mlp(10), nn.CrossEntropyLoss(), ints)[1])("multiclass", None)
    hot = torch.utils.data.TensorDataset(x, torch.nn.functional.one_hot(y, 10).float())
    assert _plan(tiny_mlp(10), nn.BCEWithLogitsLoss(), hot)[1].kind == "multilabel"
    nan = torch.utils.data.TensorDataset(x, torch.where(y == 5, float("nan"), y.float()))
    with pytest.raises(ValueError, match=r"the target of sample 5 is not finite"):
        _plan(tiny_mlp(1), nn.MSELoss(), nan)
