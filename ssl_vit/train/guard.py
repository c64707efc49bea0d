"""Divergence checks around every optimizer step.

An update is skipped when its gradients are non-finite (a non-finite loss on any rank makes them so after the
all-reduce); after too many in a row training stops. An update that was applied is checked too: if it made the
parameter norm non-finite or multiplied it by more than `max_growth` (e.g. optim.lr=1e6), the weights are ruined,
so training stops without saving them and points to the last good checkpoint. That check stays on the device
(no host-device sync per step); the trainer reads its verdict before it logs, saves, evaluates or stops, so ruined
weights are never saved and a run stops at its next log step at the latest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssl_vit.config import warmup_steps


class TrainingDiverged(RuntimeError):
    """Training stopped because the loss or the weights went bad; the message says what to change."""


class UpdateGuard:
    """`norm_of(parameters)` gives the global parameter norm as a 0-d tensor on the device (ssl_vit.train.strategy.
    parameter_norm: summed over shards when the model is sharded, a collective then)."""

    def __init__(self, parameters, max_growth: float, norm_of):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.max_growth, self.norm_of = max_growth, norm_of
        self.norm = norm_of(self.parameters).double()
        self.first_ruin = torch.full((3,), -1.0, dtype=torch.float64, device=self.norm.device)  # step, before, after

    def check_update(self, step: int) -> None:
        """After the optimizer step `step`: judge it on the device; the first ruinous one is kept for `verdict`."""
        before, after = self.norm, self.norm_of(self.parameters).double()
        self.norm = after
        ruined = ~torch.isfinite(after) | (after > self.max_growth * before.clamp(min=1.0))
        record = torch.stack([torch.full((), float(step), dtype=torch.float64, device=after.device), before, after])
        self.first_ruin = torch.where(ruined & (self.first_ruin[0] < 0), record, self.first_ruin)

    def verdict(self) -> tuple[int, float, float] | None:
        """None while every update checked was fine, else (step, norm before, norm after) of the first that was
        not (reads the device: call it where the loop syncs anyway)."""
        step, before, after = self.first_ruin.tolist()
        return None if step < 0 else (int(step), before, after)


@dataclass(frozen=True)
class DivergenceAdvice:
    """What to tell a user whose run diverged, from the settings the run uses (never advice already in use)."""

    lr: float
    grad_clip: float | None
    warmup_steps: int
    max_steps: int
    bf16: bool
    max_param_norm_growth: float
    max_consecutive_nonfinite: int

    @classmethod
    def from_config(cls, cfg) -> DivergenceAdvice:
        return cls(cfg.optim.lr, cfg.optim.grad_clip, warmup_steps(cfg.optim, cfg.trainer.max_steps),
                   cfg.trainer.max_steps, str(getattr(cfg.trainer.precision, "value", cfg.trainer.precision)) == "bf16",
                   cfg.trainer.max_param_norm_growth, cfg.trainer.max_consecutive_nonfinite)

    def tips(self, nonfinite_loss: bool) -> str:
        tips = [f"lower optim.lr (now {self.lr:g})"]
        if not self.grad_clip:
            tips.append("set optim.grad_clip=1.0 (clipping is off)")
        if self.warmup_steps < min(1000, self.max_steps // 20):
            tips.append(f"lengthen optim.warmup_steps (now {self.warmup_steps})")
        if self.bf16:
            tips.append("try trainer.precision=fp32 to rule out bf16 range problems")
        if nonfinite_loss:
            tips.append("check the data for broken samples")
        return "; ".join(tips)

    def ruined_weights_error(self, step: int, growth: tuple[float, float], last_checkpoint,
                             stopped_at: int | None = None) -> TrainingDiverged:
        later = f" (found at step {stopped_at})" if stopped_at not in (None, step) else ""
        return TrainingDiverged(
            f"the update of step {step}{later} took the parameter norm from {growth[0]:.4g} to {growth[1]:.4g} (limit: "
            f"x{self.max_param_norm_growth}, trainer.max_param_norm_growth); the weights are ruined and were not "
            f"saved. Last good checkpoint: {last_checkpoint or 'none (none was saved yet)'}. To fix: "
            f"{self.tips(nonfinite_loss=False)}")

    def nonfinite_error(self, consecutive: int, step: int, checkpoint) -> TrainingDiverged:
        return TrainingDiverged(
            f"the loss or its gradients were non-finite for {consecutive} consecutive steps (up to step {step}, limit "
            f"trainer.max_consecutive_nonfinite={self.max_consecutive_nonfinite}); those updates were skipped, "
            f"so the weights saved in {checkpoint} are those of the last applied update. To fix: "
            f"{self.tips(nonfinite_loss=True)}")
