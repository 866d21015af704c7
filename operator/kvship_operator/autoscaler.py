"""The built-in autoscaler's decision logic: pure, no API calls, time passed in.

Every tick the operator hands over one sample (the sum of waiting + running requests over
the ready pods it could scrape) and what the cluster looks like (current replicas, pods
still starting). The autoscaler

1. smooths the load with a moving average over the last ``average_window`` seconds,
2. turns it into a recommendation ``ceil(load / target)``, clamped to ``[min, max]``,
3. keeps a history of recommendations and, like the HPA's behaviour field, scales up to the
   lowest recommendation of the last ``scale_up_window`` seconds (0: at once) and down to
   the highest recommendation of the last ``scale_down_window`` seconds, and only once that
   much history exists (so a restarted operator, or a fresh resource, never scales down on
   a few samples). Scaling up always wins over a pending scale-down, and a recommendation
   between the two (no change) resets nothing: flapping needs the load to stay low for a
   whole window after it was last high.
4. never scales down while a pod is still starting (created, not ready, within its startup
   period): removing replicas then could take away the pod that is loading the model, and
   its load is not visible yet.

Replicas outside ``[min, max]`` (the bounds were edited) are brought back at once. Without
pods there is no load to read: the lower bound here is ``max(min, 1)``, and going to zero and
back (minReplicas 0, with a router) is decided in ``scale_zero`` from the router's signal.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_per_replica: float
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    average_window: float = 45.0  # 3 polling intervals by default (see from_spec)

    @classmethod
    def from_spec(cls, autoscaling) -> "Policy":
        """From a parsed `spec.autoscaling` (kvship_operator.spec.Autoscaling)."""
        return cls(
            min_replicas=autoscaling.min_replicas,
            max_replicas=autoscaling.max_replicas,
            target_per_replica=float(autoscaling.target_requests_per_replica),
            scale_up_window=float(autoscaling.scale_up_stabilization_seconds),
            scale_down_window=float(autoscaling.scale_down_stabilization_seconds),
            average_window=3.0 * autoscaling.interval_seconds,
        )

    @property
    def lower(self) -> int:
        return max(self.min_replicas, 1)

    @property
    def upper(self) -> int:
        return max(self.max_replicas, self.lower)

    def clamp(self, n: int) -> int:
        return min(max(n, self.lower), self.upper)


@dataclass(frozen=True)
class Decision:
    replicas: int  # what spec.replicas should be (== current: leave it)
    recommendation: int  # the raw, clamped recommendation of this tick
    load: Optional[float]  # the smoothed load it is based on (None: no sample)
    reason: str  # CamelCase: ScaleUp, ScaleDown, OutOfBounds, Steady, Stabilizing, PodsStarting, NoMetrics
    message: str

    @property
    def changed(self) -> bool:
        return self.reason in ("ScaleUp", "ScaleDown", "OutOfBounds", "ScaleFromZero", "ScaleToZero")


@dataclass
class Autoscaler:
    """State for one LLMDeployment: load samples and past recommendations."""

    samples: deque = field(default_factory=deque)  # (time, total waiting+running)
    recommendations: deque = field(default_factory=deque)  # (time, replicas)
    first_seen: Optional[float] = None
    # scale to zero (scale_zero.py): when work was last seen, and the router's refusals then
    last_busy: Optional[float] = None
    router_refused: Optional[float] = None

    def observe(self, now: float, total: Optional[float]) -> None:
        if self.first_seen is None:
            self.first_seen = now
        if total is not None:
            self.samples.append((now, float(total)))

    def _average(self, now: float, window: float) -> Optional[float]:
        while self.samples and self.samples[0][0] <= now - window:
            self.samples.popleft()
        if not self.samples:
            return None
        return sum(v for _, v in self.samples) / len(self.samples)

    def decide(self, policy: Policy, now: float, current: int, *, starting: int = 0) -> Decision:
        """What replicas should be at ``now``, given the samples observed so far."""
        load = self._average(now, policy.average_window)
        if current < policy.lower or current > policy.upper:
            target = policy.clamp(current)
            return Decision(target, target, load, "OutOfBounds",
                            f"replicas {current} outside {policy.lower}..{policy.upper}: set to {target}")
        if load is None:
            return Decision(current, current, None, "NoMetrics", "no load sample from any ready pod; holding")

        rec = policy.clamp(math.ceil(load / policy.target_per_replica - 1e-9))
        self.recommendations.append((now, rec))
        keep = max(policy.scale_up_window, policy.scale_down_window)
        while self.recommendations and self.recommendations[0][0] < now - keep:
            self.recommendations.popleft()
        what = f"load {load:.1f} (target {policy.target_per_replica:g} per replica) -> {rec}"

        if rec > current:
            up = min(r for t, r in self.recommendations if t >= now - policy.scale_up_window)
            if up > current:
                return Decision(up, rec, load, "ScaleUp", f"{what}; scaling up {current} -> {up}")
            return Decision(current, rec, load, "Stabilizing",
                            f"{what}; scale-up held by the {policy.scale_up_window:g} s window")
        if rec < current:
            down = max(r for t, r in self.recommendations if t >= now - policy.scale_down_window)
            covered = self.first_seen is not None and now - self.first_seen >= policy.scale_down_window
            if down >= current or not covered:
                return Decision(current, rec, load, "Stabilizing",
                                f"{what}; scale-down held by the {policy.scale_down_window:g} s window")
            if starting:
                return Decision(current, rec, load, "PodsStarting",
                                f"{what}; scale-down held while {starting} pod(s) start")
            return Decision(down, rec, load, "ScaleDown", f"{what}; scaling down {current} -> {down}")
        return Decision(current, rec, load, "Steady", what)
