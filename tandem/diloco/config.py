"""DiLoCo's settings: :class:`DiLoCoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DiLoCoConfig"]


# Note [local steps and the outer step] in tandem/diloco/diloco.py
@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """Local steps and the outer step that syncs them. The defaults are DiLoCo's
    (Douillard et al., arXiv 2311.08105): Nesterov SGD at lr 0.7, momentum 0.9.
    :meth:`local_sgd` is the special case that averages the parameters."""

    sync_every: int = 100
    """Inner steps between two syncs of a fragment (DiLoCo's H): the ranks send
    nothing in between, so the bytes per step are 1/H of an all-reduce's."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate (SGD on the averaged pseudo-gradient)."""
    outer_momentum: float = 0.9
    """The outer optimizer's momentum (0: none)."""
    nesterov: bool = True
    """Nesterov momentum for the outer step, as the paper."""
    fragments: int = 1
    """Streaming DiLoCo (arXiv 2501.18512): the parameters in this many fragments,
    each synced every ``sync_every`` steps at its own offset, so that the link
    carries 1/fragments of the model at a time; 1 is DiLoCo."""
    overlap: int = 0
    """Inner steps a fragment's sync runs beside before it is applied (Streaming
    DiLoCo's tau): its communication hides behind them. 0 waits at once."""
    mix: float = 0.0
    """At a fragment's sync, the share of the local parameters kept: the
    fragment becomes ``mix * local + (1 - mix) * synced`` (Streaming DiLoCo's
    alpha; 0 takes the synced parameters, as DiLoCo)."""
    quantize: int | None = None  # Note [a quantized average] in tandem/quantized/average.py
    """8 or 4: the pseudo-gradients averaged in int8 or int4 blocks of 256 values
    with a scale each, with error feedback (what a sync loses is sent at the
    next), reduced in fp32 inside each node first; None sends fp32."""

    def __post_init__(self) -> None:
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DiLoCoConfig.{name} must be an int >= 1, got {value!r}")
        if self.fragments > self.sync_every:
            raise ValueError(f"DiLoCoConfig.fragments={self.fragments} must be at most sync_every="
                             f"{self.sync_every}: each fragment syncs at its own step of the {self.sync_every}")
        if not isinstance(self.overlap, int) or not 0 <= self.overlap < self.sync_every:
            raise ValueError(f"DiLoCoConfig.overlap must be an int in [0, sync_every={self.sync_every}), "
                             f"got {self.overlap!r}")
        if not 0.0 <= self.mix < 1.0:
            raise ValueError(f"DiLoCoConfig.mix must be in [0, 1), got {self.mix!r}")
        if not self.outer_lr > 0 or not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"DiLoCoConfig: outer_lr={self.outer_lr!r} must be > 0 and outer_momentum="
                             f"{self.outer_momentum!r} in [0, 1)")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("DiLoCoConfig: nesterov=True needs outer_momentum > 0 (or nesterov=False)")
        if self.quantize not in (None, 8, 4):
            raise ValueError(f"DiLoCoConfig.quantize must be None, 8 or 4, got {self.quantize!r}")

    @property
    def whole(self) -> bool:
        """Whether each sync is of the whole model, applied at once (one fragment,
        no overlap, no mix): after a sync, every rank holds the synced parameters."""
        return self.fragments == 1 and not self.overlap and not self.mix

    def check_elastic(self, who: str) -> None:
        """Raises ValueError unless an elastic job can go back to this config's syncs
        (when a rank is lost, every rank goes back to the last sync of the whole
        model); ``who`` names the caller."""
        # Note [elastic local steps] in tandem/elastic/sync_points.py
        if not self.whole:
            raise ValueError(
                f"{who}: diloco in an elastic job goes back to the last sync of the whole model when a rank is "
                f"lost: it needs fragments=1, overlap=0 and mix=0, got fragments={self.fragments}, "
                f"overlap={self.overlap}, mix={self.mix}; or run without --elastic (elastic=False)")

    @classmethod
    def local_sgd(cls, sync_every: int, **kw: object) -> DiLoCoConfig:
        """LocalSGD: the parameters averaged every ``sync_every`` steps (the outer
        step is SGD at lr 1 without momentum, which sets each parameter to the
        ranks' average)."""
        return cls(sync_every=sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False, **kw)  # type: ignore[arg-type]
