"""Mixup, cutmix and label smoothing on the device, as timm's ``Mixup`` (``mode="batch"``).

``OneCycleTrainer(..., mixup=0.2, cutmix=1.0, label_smoothing=0.1)`` mixes every
training batch on the device after normalisation: one ``lam`` per batch drawn
from ``Beta(alpha, alpha)`` with the device RNG (when both are on, cutmix is
chosen with probability 0.5 per batch, as timm's ``switch_prob``), the batch
mixed with its reverse (``x.flip(0)``), the cutmix box pasted through a mask
(fixed shapes: no slicing by drawn numbers) and ``lam`` corrected to the box
area (timm's ``correct_lam=True``). Targets become soft targets
(:func:`soft_targets`): one-hot with ``label_smoothing`` (``1 - s + s/C`` on,
``s/C`` off) for class indices, ``y (1 - s) + s/2`` for multi-hot rows, mixed
with the same ``lam``. ``nn.CrossEntropyLoss`` and ``nn.BCEWithLogitsLoss``
accept such targets as they are (timm's ``SoftTargetCrossEntropy``).

Every random number comes from the device RNG and every branch is computed
with ``torch.where``, so each step runs the same graph (no recompiles, no host
reads). The draws of a chunk of steps (:data:`CHUNK_STEPS`, 64; fewer for images over
256x256, :func:`chunk_steps`) come from one ``torch.rand`` call in a small graph of their
own, run at an epoch's start and when a chunk is used up (:meth:`DeviceMix.prepare`), and
stay stacked on the device; a step then picks its row by an index that is device data and
blends: 12-13 IR nodes for torch_xla to trace and hash per step (soft targets by one lookup
in a class table, two row lookups, two ``torch.lerp``), against about 140 when each step
drew its own numbers. The whole step graph's host cost grows with its node count, and the
chunk's own graph costs two syncs and a launch, so both are kept small: together they
keep mixing within a few per cent of a plain step even on small networks.
The Beta draws use Johnk's method (:func:`beta_logit_johnk`) when both alphas are <= 1
(timm's usual 0.2-1.0) and :func:`sample_gamma` (Marsaglia-Tsang) otherwise, each with a
fixed number of vectorised candidates. Mixup and cutmix are one blend of the batch
with its reverse under a per-pixel weight drawn with the chunk (``lam`` everywhere, or 0
inside the box and 1 outside; :func:`mix_params`, :func:`blend`), so a step computes one
blend whichever was drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .config import AugmentSettings

__all__ = ["MixConfig", "check_mix_loss", "sample_gamma", "sample_beta",
           "beta_logit_johnk",
           "soft_targets", "cutmix_box", "mix_params", "blend", "mix_batch", "DeviceMix",
           "CHUNK_STEPS", "CHUNK_BYTES", "chunk_steps", "SOFT_TARGET_LOSSES",
           "mix_config_for"]

# Candidates per Gamma draw: Marsaglia-Tsang accepts >= 95% of them, so all
# GAMMA_CANDIDATES are rejected with probability < 0.05 ** 16 (about 1e-21).
GAMMA_CANDIDATES = 16
# Candidates per Johnk Beta draw (alpha <= 1): each is accepted with probability >= 1/2.
JOHNK_CANDIDATES = 64
SWITCH_PROB = 0.5  # timm's default chance of cutmix per batch when both are on

# Losses that take [B, C] probability targets as they are.
SOFT_TARGET_LOSSES = ("CrossEntropyLoss", "BCEWithLogitsLoss", "SoftTargetCrossEntropy",
                      "BinaryCrossEntropy", "cross_entropy", "binary_cross_entropy_with_logits")


@dataclass(frozen=True)
class MixConfig:
    """What :class:`DeviceMix` does to each training batch.

    Attributes:
        mixup: Beta alpha of mixup (0 = off).
        cutmix: Beta alpha of cutmix (0 = off).
        label_smoothing: Target smoothing ``s`` in [0, 1).
        num_classes: Output width (the one-hot width for class-index targets).
        multilabel: Targets are multi-hot float rows ``[B, C]``.
        image_hw: ``(H, W)`` of the model's image inputs (None: unknown or not images;
            cutmix then learns it from the first batch).
    """

    mixup: float
    cutmix: float
    label_smoothing: float
    num_classes: int
    multilabel: bool = False
    image_hw: tuple[int, int] | None = None


def check_mix_loss(loss: Callable, targets_kind: str, input_shape: tuple | None,
                   cutmix: float) -> None:
    """Refuse mixing that cannot work, before any device time.

    Args:
        loss: The trainer's loss.
        targets_kind: ``"index"`` (class indices), ``"multihot"`` or ``"other"``
            (regression or anything else).
        input_shape: One sample's input shape (None: unknown).
        cutmix: The cutmix alpha.

    Raises:
        ValueError: regression targets, a loss that does not take soft targets, or
            cutmix on inputs that are not images.
    """
    name = getattr(loss, "__name__", None)
    if not isinstance(name, str):
        name = type(loss).__name__
    if targets_kind == "other":
        raise ValueError("mixup/cutmix/label_smoothing need classification targets (class indices, "
                         "multi-hot rows or a one-logit binary model's 0/1); these targets are "
                         "regression targets (a regression cache or loss), which the trainer does not "
                         "mix. Fix: mixup=0, cutmix=0, label_smoothing=0")
    if name not in SOFT_TARGET_LOSSES and not getattr(loss, "soft_targets", False):
        raise ValueError(f"mixup/cutmix/label_smoothing turn targets into [B, C] probabilities, "
                         f"which the loss {name} does not take (a regression or hard-label loss). "
                         "Fix: loss=nn.CrossEntropyLoss() (single-label) or nn.BCEWithLogitsLoss() "
                         "(multi-label), mark a custom soft-target loss with "
                         "loss.soft_targets = True, or set mixup=0, cutmix=0, label_smoothing=0")
    if cutmix > 0 and input_shape is not None and len(input_shape) != 3:
        raise ValueError(f"cutmix pastes boxes into images [C, H, W]; these inputs have shape "
                         f"{tuple(input_shape)}. Fix: cutmix=0 (mixup works on any input)")


def sample_gamma(alpha: torch.Tensor, candidates: int = GAMMA_CANDIDATES,
                 log: bool = False) -> torch.Tensor:
    """``Gamma(alpha, 1)`` draws, one per element of ``alpha``, from the RNG of ``alpha``'s device.

    Marsaglia and Tsang (2000) with ``candidates`` vectorised proposals per draw
    (the first accepted one is kept) and the ``alpha < 1`` boost
    ``Gamma(alpha) = Gamma(alpha + 1) U^(1/alpha)``: fixed shapes, no host reads.

    Args:
        alpha: float tensor of shape parameters (> 0), any shape.
        candidates: Proposals per draw (default 16).
        log: Return ``log G`` instead of ``G`` (default False).

    Returns:
        float32 tensor shaped like ``alpha``.
    """
    a = alpha.float()
    boost = a < 1
    a1 = torch.where(boost, a + 1, a)
    d = (a1 - 1.0 / 3.0).unsqueeze(-1)
    c = 1.0 / torch.sqrt(9.0 * d)
    shape = tuple(a.shape) + (candidates,)
    x = torch.randn(shape, device=a.device)
    u = torch.rand(shape, device=a.device)
    v = (1 + c * x) ** 3
    vpos = v.clamp_min(1e-30)
    ok = (v > 0) & (torch.log(u.clamp_min(1e-30)) < 0.5 * x * x + d - d * vpos + d * torch.log(vpos))
    first = ok & (torch.cumsum(ok.to(torch.int32), dim=-1) == 1)
    g = torch.where(first, d * vpos, torch.zeros_like(vpos)).sum(-1)
    g = torch.where(ok.any(-1), g, d.squeeze(-1))  # never in practice: the mean instead
    ub = torch.rand(tuple(a.shape), device=a.device).clamp_min(1e-38)
    if not log:
        return torch.where(boost, g * ub ** (1.0 / a), g)
    # log space: for small alpha, G(alpha) underflows float32 (U ** (1 / alpha))
    return torch.log(g.clamp_min(1e-38)) + torch.where(boost, torch.log(ub) / a,
                                                       torch.zeros_like(a))


def sample_beta(alpha: torch.Tensor) -> torch.Tensor:
    """``Beta(alpha, alpha)`` draws (one per element of ``alpha``) as ``G1 / (G1 + G2)``,
    computed as ``sigmoid(log G1 - log G2)`` (no underflow for small alphas)."""
    lg = sample_gamma(torch.stack([alpha, alpha]), log=True)
    return torch.sigmoid(lg[0] - lg[1])


def beta_logit_johnk(alpha: torch.Tensor, candidates: int = 0,
                     u: torch.Tensor | None = None) -> torch.Tensor:
    """``logit(lam)`` of ``Beta(alpha, alpha)`` draws for ``alpha <= 1``, one per element of
    ``alpha``, by Johnk's method (1964): for uniforms ``U, V`` let ``X = U^(1/alpha)``,
    ``Y = V^(1/alpha)``; given ``X + Y <= 1``, ``X / (X + Y)`` is ``Beta(alpha, alpha)``.

    Each draw takes the first accepted of ``candidates`` vectorised proposals (fixed
    shapes, no host reads, about 15 graph ops, against about 50 for
    :func:`sample_beta`). A proposal is accepted with probability
    ``Gamma(1 + alpha)^2 / Gamma(1 + 2 alpha)``, at least 1/2 for ``alpha <= 1``
    (0.95 at 0.2), so all 64 default candidates fail with probability below 2^-64;
    then the draw is 0 (``lam = 0.5``). Computed in log space (``log X = log U / alpha``),
    so small alphas do not underflow.

    Args:
        alpha: float tensor of shape parameters in (0, 1], any shape.
        candidates: Proposals per draw (default :data:`JOHNK_CANDIDATES`, 64; ignored
            when ``u`` is given).
        u: Uniforms ``alpha.shape + (2, candidates)`` to use instead of drawing them.

    Returns:
        float32 tensor shaped like ``alpha``: ``log X - log Y``; ``sigmoid`` of it is the draw.
    """
    a = alpha.float()
    if u is None:
        u = torch.rand(tuple(a.shape) + (2, candidates or JOHNK_CANDIDATES), device=a.device)
    lu = torch.log(u.clamp_min(1e-38)) / a.unsqueeze(-1).unsqueeze(-1)  # log X, log Y
    ok = torch.exp(lu).sum(-2) <= 1  # X + Y <= 1 (an underflow to 0 is a true accept)
    lx, ly = lu.unbind(-2)
    first = ok & (torch.cumsum(ok.to(torch.int32), dim=-1) == 1)
    return torch.where(first, lx - ly, torch.zeros_like(lx)).sum(-1)


def soft_targets(y: torch.Tensor, num_classes: int, smoothing: float,
                 multilabel: bool) -> torch.Tensor:
    """timm's smoothed targets before mixing: one-hot ``1 - s + s/C`` / ``s/C`` for class
    indices, ``y (1 - s) + s/2`` for multi-hot rows (float32 ``[B, C]``)."""
    if multilabel:
        return y.float() * (1.0 - smoothing) + 0.5 * smoothing if smoothing else y.float()
    on, off = _on_off(smoothing, num_classes)
    hit = y.long().view(-1, 1) == torch.arange(num_classes, device=y.device).view(1, -1)
    return torch.where(hit, torch.full_like(hit, on, dtype=torch.float32),
                       torch.full_like(hit, off, dtype=torch.float32))


def _on_off(smoothing: float, num_classes: int) -> tuple[float, float]:
    """timm's one-hot target values with smoothing ``s``: ``(1 - s + s/C, s/C)``."""
    off = smoothing / num_classes
    return 1.0 - smoothing + off, off


def cutmix_box(lam: torch.Tensor, centre: torch.Tensor, size: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's ``rand_bbox`` for the drawn centre, rows and columns in one vector op.

    Args:
        lam: 0-d float tensor, the drawn mixing weight.
        centre: float tensor ``[2]``, the box centre ``(cy, cx)`` (whole numbers).
        size: float tensor ``[2]``, the image's ``(H, W)``.

    Returns:
        ``(lo, hi)``: float tensors ``[2]`` of whole numbers, ``(yl, xl)`` and ``(yh, xh)``
        of the box of side ``sqrt(1 - lam)`` of the image, clipped to it.
    """
    cut = torch.floor(size * torch.sqrt((1 - lam).clamp_min(0)))
    half = torch.floor(cut * 0.5)  # cut // 2; (cut + 1) // 2 is cut - half
    lo = (centre - half).clamp_min(0)
    hi = torch.minimum(centre + (cut - half), size)
    return lo, hi


def mix_params(lam: torch.Tensor, use_cutmix: torch.Tensor | bool, centre: torch.Tensor | None,
               size: torch.Tensor | None, hw: tuple[int, int] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blend parameters of ``K`` steps from their draws (vectorised over the leading axis).

    Each step's pixel weight ``w`` (the share of the batch itself; ``1 - w`` of its reverse)
    is ``lam`` everywhere for mixup, and 0 inside the cutmix box and 1 outside it for
    cutmix (timm's ``rand_bbox``, :func:`cutmix_box`).

    Args:
        lam: float ``[K]``, the drawn mixing weights.
        use_cutmix: bool ``[K]`` (or a Python bool for all), cutmix instead of mixup.
        centre: float ``[K, 2]`` box centres ``(row, column)``, whole numbers (None when
            ``use_cutmix is False``).
        size: float ``[2]``, ``(H, W)`` on the device (None when ``use_cutmix is False``).
        hw: ``(H, W)`` as ints (None when ``use_cutmix is False``).

    Returns:
        ``(lam_y, w)``: ``lam_y`` ``[K]`` is the targets' weight, with cutmix corrected to
        ``1 - box area / (H W)`` (timm's ``correct_lam``); ``w`` is ``[K, H, W]``, or
        ``[K]`` (``lam``) without cutmix.
    """
    if use_cutmix is False:
        return lam, lam
    h, w = hw
    lo, hi = cutmix_box(lam.unsqueeze(-1), centre, size)  # [K, 2] each
    rows = torch.arange(h, device=lam.device, dtype=torch.float32).view(1, h)
    cols = torch.arange(w, device=lam.device, dtype=torch.float32).view(1, w)
    r = ((rows >= lo[:, :1]) & (rows < hi[:, :1])).float()
    c = ((cols >= lo[:, 1:]) & (cols < hi[:, 1:])).float()
    box = r.unsqueeze(2) * c.unsqueeze(1)  # [K, H, W]: 1 inside the box
    lam_cut = 1.0 - (hi - lo).prod(-1) / float(h * w)
    if use_cutmix is True:
        return lam_cut, 1.0 - box
    pick = use_cutmix.view(-1, 1, 1)
    return (torch.where(use_cutmix, lam_cut, lam),
            torch.where(pick, 1.0 - box, lam.view(-1, 1, 1).expand(-1, h, w)))


def blend(x: torch.Tensor, y_soft: torch.Tensor, params: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's mix, as timm's ``Mixup._mix_batch`` + ``mixup_target``:
    ``lerp(x.flip(0), x, w)`` and ``lerp(y.flip(0), y, lam_y)`` (``x w + x.flip(0) (1 - w)``;
    exact copies where ``w`` is 0 or 1, as ``torch.lerp`` computes them). Four traced ops.

    Args:
        x: float inputs ``[B, ...]`` (``[B, C, H, W]`` with cutmix).
        y_soft: float targets ``[B, C]`` (see :func:`soft_targets`).
        params: One step's ``(lam_y, w)``: 0-d (or ``[1]``), and 0-d or ``[H, W]`` (or
            ``[1]``, ``[1, H, W]``: a row picked from a chunk); see :func:`mix_params`.

    Returns:
        ``(x_mixed, y_mixed)``.
    """
    lam_y, w = params
    return (torch.lerp(x.flip(0), x, w.to(x.dtype)),
            torch.lerp(y_soft.flip(0), y_soft, lam_y.to(y_soft.dtype)))


def mix_batch(x: torch.Tensor, y_soft: torch.Tensor, lam: torch.Tensor,
              use_cutmix: torch.Tensor | bool, centre: torch.Tensor | None = None,
              size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix a batch with its reverse as timm's ``Mixup._mix_batch`` + ``mixup_target``
    (:func:`mix_params` for one step, then :func:`blend`: what :class:`DeviceMix` runs).

    Args:
        x: float inputs ``[B, ...]`` (``[B, C, H, W]`` for cutmix).
        y_soft: float targets ``[B, C]`` (see :func:`soft_targets`).
        lam: 0-d float tensor, the drawn mixing weight.
        use_cutmix: 0-d bool tensor (or a Python bool) choosing cutmix over mixup.
        centre: float tensor ``[2]``, the cutmix box centre ``(row, column)`` in whole
            numbers (needed unless ``use_cutmix is False``).
        size: float tensor ``[2]`` ``(H, W)`` on ``x``'s device (default: made here,
            one small host->device copy).

    Returns:
        ``(x_mixed, y_mixed)``; with cutmix ``lam`` is corrected to ``1 - box area / (H W)``.
    """
    hw = None
    if use_cutmix is not False:
        hw = (x.shape[-2], x.shape[-1])
        if size is None:
            size = torch.tensor([float(k) for k in hw]).to(x.device)
        centre = centre.view(1, 2)
        if not isinstance(use_cutmix, bool):
            use_cutmix = use_cutmix.view(1)
    lam_y, w = mix_params(lam.view(1), use_cutmix, centre, size, hw)
    return blend(x, y_soft, (lam_y[0], w[0]))


# Steps drawn at once by DeviceMix (one small graph of their own per chunk, two outputs
# whatever the chunk's length, so its compile no longer grows with it). Each chunk costs
# two syncs and a launch, spread over more steps at 64 than at 16; the in-process probes
# comparing the two sat inside this machine's noise (docs/BENCHMARKS.md).
CHUNK_STEPS = 64
# The chunk's pixel weights are [K, H, W] float32: K shrinks for large images so that
# they stay under this many bytes per device (16 MiB: 64 steps up to 256x256 pixels).
CHUNK_BYTES = 16 << 20


def chunk_steps(hw: tuple[int, int] | None, chunk: int | None = None) -> int:
    """Steps per chunk of draws: ``chunk`` when given, else :data:`CHUNK_STEPS` (64), fewer
    (at least 8) when the ``[K, H, W]`` float32 pixel weights would exceed
    :data:`CHUNK_BYTES`."""
    if chunk:
        return int(chunk)
    if hw is None:
        return CHUNK_STEPS
    return max(8, min(CHUNK_STEPS, CHUNK_BYTES // (4 * hw[0] * hw[1])))


class DeviceMix:
    """``(x, y) -> (x mixed, soft targets)`` for one training batch, all on the device.

    The random numbers of a chunk of steps (:func:`chunk_steps`: 64, fewer for large
    images) are drawn at once, in a small graph of their own (:meth:`prepare`): per step
    the Beta draw (:func:`beta_logit_johnk` when both alphas are <= 1, timm's usual
    values; :func:`sample_beta` with Marsaglia-Tsang otherwise), the mixup/cutmix switch
    and the box centre, all from one ``torch.rand`` call, turned into the blend
    parameters of every step (:func:`mix_params`), kept stacked on the device. A training
    step then picks its own row with an index that is device data (made once per chunk
    length) and blends (:func:`blend`): 12-13 IR nodes per step, the same graph every step,
    against about 140 when each step drew its own numbers.

    Use: :meth:`start_epoch` after seeding the device RNG at an epoch's start (draws
    then depend only on that seed, so a resumed epoch draws the same), :meth:`prepare`
    before each step's first op (nothing else pending), then ``mix(x, y)``. Without
    :meth:`prepare` a call draws its chunk inside the step's graph.

    Args:
        cfg: The :class:`MixConfig`.
        dev: The replica's device (the alphas live there as device data).
        chunk: Steps drawn at once (default: :func:`chunk_steps` of the image size).
    """

    def __init__(self, cfg: MixConfig, dev: torch.device, chunk: int | None = None):
        from .. import runtime

        self.cfg, self.dev, self._chunk = cfg, dev, chunk
        self._mixing = cfg.mixup > 0 or cfg.cutmix > 0
        self._johnk = all(a <= 1 for a in (cfg.mixup, cfg.cutmix) if a > 0)
        # Device data, not constants: the graph is the same whatever the values.
        self._alphas = runtime.to_device(torch.tensor([cfg.mixup or 1.0, cfg.cutmix or 1.0]), dev)
        self._table = None
        if not cfg.multilabel:  # row i: the soft target of class i (device data: one lookup a step)
            self._table = runtime.to_device(
                soft_targets(torch.arange(cfg.num_classes), cfg.num_classes, cfg.label_smoothing,
                             False), dev)
        self._sizes: dict[tuple[int, int], torch.Tensor] = {}
        self._index: list[torch.Tensor] = []  # [1] int64 device data: 0 .. chunk - 1
        self._params: tuple[torch.Tensor, torch.Tensor] | None = None  # the chunk's (lam_y, w)
        self._next = 0  # the chunk's next unused step
        self._hw = cfg.image_hw if cfg.cutmix > 0 else None  # the box's image size

    @property
    def chunk(self) -> int:
        """Steps per chunk of draws at the current image size."""
        return chunk_steps(self._hw, self._chunk)

    def start_epoch(self) -> None:
        """Forget the unused draws: the next step draws a new chunk (call it after
        seeding the device RNG, so an epoch's draws depend only on its seed)."""
        self._params = None

    def _used_up(self) -> bool:
        return self._params is None or self._next >= len(self._index)

    def prepare(self) -> None:
        """Draw the next chunk when this one is used up, as a graph of its own (it
        syncs: call it where nothing else is pending, before a step's first op)."""
        from .. import runtime

        if not self._mixing or not self._used_up():
            return
        if self.cfg.cutmix > 0 and self._hw is None:
            return  # image size unknown until the first call: drawn in that step
        runtime.sync()  # what is pending (a run's first step) stays out of the chunk's graph
        self._draw_chunk(self._hw)
        runtime.sync()

    def _draw_chunk(self, hw: tuple[int, int] | None) -> None:
        """Draw the blend parameters of :attr:`chunk` steps (pending ops) and start using them."""
        from .. import runtime

        cfg, k, dev = self.cfg, chunk_steps(hw, self._chunk), self.dev
        if len(self._index) != k:  # one transfer, once per chunk length
            self._index = list(runtime.to_device([torch.tensor([i]) for i in range(k)], dev))
        if self._johnk:
            j = JOHNK_CANDIDATES
            u = torch.rand(k, 4 * j + 3, device=dev)
            lams = torch.sigmoid(beta_logit_johnk(self._alphas.expand(k, 2),
                                                  u=u[:, :4 * j].reshape(k, 2, 2, j)))
            u = u[:, 4 * j:]
        else:
            lams, u = sample_beta(self._alphas.expand(k, 2)), torch.rand(k, 3, device=dev)
        use_cutmix: torch.Tensor | bool = cfg.cutmix > 0
        if cfg.mixup > 0 and cfg.cutmix > 0:
            use_cutmix = u[:, 0] < SWITCH_PROB
            lam = torch.where(use_cutmix, lams[:, 1], lams[:, 0])
        else:
            lam = lams[:, 1] if use_cutmix else lams[:, 0]
        centre = size = None
        if use_cutmix is not False:
            size = self._size(hw)
            centre = torch.minimum(torch.floor(u[:, 1:] * size), size - 1)  # randint(0, H), (0, W)
        self._params, self._next = mix_params(lam, use_cutmix, centre, size, hw), 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        y_soft = self._soft(y)
        if not self._mixing:
            return x, y_soft
        hw = (x.shape[-2], x.shape[-1]) if cfg.cutmix > 0 else None
        if hw != self._hw or self._used_up():  # unprepared (or another image size)
            self._hw = hw
            self._draw_chunk(hw)
        idx = self._index[self._next]
        self._next += 1
        lam_y, w = self._params
        return blend(x, y_soft, (lam_y.index_select(0, idx), w.index_select(0, idx)))

    def _soft(self, y: torch.Tensor) -> torch.Tensor:
        """:func:`soft_targets` of ``y`` with the class numbers kept as device data."""
        cfg = self.cfg
        if cfg.multilabel:
            return soft_targets(y, cfg.num_classes, cfg.label_smoothing, True)
        return self._table.index_select(0, y if y.dim() == 1 else y.view(-1))

    def _size(self, hw: tuple[int, int]) -> torch.Tensor:
        """``(H, W)`` as device data, made once per image size (a tensor made from
        numbers in a graph would be copied to the device every time)."""
        from .. import runtime

        if hw not in self._sizes:
            self._sizes[hw] = runtime.to_device(torch.tensor([float(k) for k in hw]), self.dev)
        return self._sizes[hw]


def mix_config_for(augment: AugmentSettings, loss: Callable, model: torch.nn.Module, data, spec: Any,
                   prepare: Callable, eval_step: Callable) -> MixConfig | None:
    """The :class:`MixConfig` of a fit run (None when mixup, cutmix and label smoothing
    are off), found and checked on the host before any device time.

    Args:
        augment: The trainer's augmentation settings (``mixup``, ``cutmix``, ``label_smoothing``).
        loss, model, eval_step: The trainer's.
        data: The training data as the loader collates it.
        spec: Its :class:`~xla_utils.step.inputs.InputSpec`.
        prepare: ``x -> model input`` (to measure the output width on the host).

    Raises:
        ValueError: see :func:`check_mix_loss`; or the number of classes is unknown.
    """
    if not (augment.mixup > 0 or augment.cutmix > 0 or augment.label_smoothing > 0):
        return None
    from ..step.inputs import loss_kind, output_width, targets_of

    targets, _ = targets_of(data)
    kind = "other"
    if getattr(data, "task", None) == "regression" or loss_kind(loss) == "regression":
        kind = "other"  # regression targets are not mixed
    elif targets is not None and targets.dtype.kind in "iu" and targets.ndim == 1:
        kind = "index"
    elif targets is not None and targets.dtype.kind == "f" and targets.ndim == 2:
        kind = "multihot"  # (also a one-logit binary model's float32 [N, 1] targets)
    shape = getattr(spec, "shape", None)
    check_mix_loss(loss, kind, shape, augment.cutmix)
    width = targets.shape[1] if kind == "multihot" else output_width(model, data, prepare,
                                                                      eval_step)
    if width is None:
        width = getattr(data, "num_classes", None)
    if width is None:
        raise ValueError("mixup/cutmix/label_smoothing need the number of classes and it could not "
                         "be found (the model's output on two samples was not [B, C]). Fix: give "
                         "the training data a num_classes attribute, or set mixup=0, cutmix=0, "
                         "label_smoothing=0")
    chw = getattr(spec, "image_chw", None)
    return MixConfig(mixup=float(augment.mixup), cutmix=float(augment.cutmix),
                     label_smoothing=float(augment.label_smoothing), num_classes=int(width),
                     multilabel=kind == "multihot",
                     image_hw=tuple(chw[1:]) if chw is not None and len(chw) == 3 else None)
