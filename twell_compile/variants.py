"""A rewritten graph compiled twice, and the choice between the two at every call.

What the backend returns for a graph with FFNs on a GPU (``GraphVariants``):

* the **dense variant**: the graph as the model wrote it, each FFN with the L1 term and twell's
  counters added (``native_ffn``), compiled by Inductor, which fuses the FFN with its neighbours
  (the norm before it, the residual after it) and launches it with no per-op host work;
* the **TwELL variant**: the FFNs as TwELL ops (``rewrite_ffn``), each choosing its own path at
  every call.

Both compute the same function and inject the same L1 gradient; they differ in speed. A model
trained from scratch starts ~50% dense, where the op's sparse path cannot win and its dense path
costs host time that Inductor's code does not: so graphs start on the dense variant. The choice
is made per model (``ModelVariants``: all graphs of one model, in one mode, switch together, so
that a model compiled per decoder layer is measured as a whole). Once at least half of the
model's layers prefer the sparse path (their measured density and dense rows,
``lowering.prefers_sparse``), it *measures*: each variant runs for a few steps, and the one with
the shorter step (the period between calls of the model's first graph: the step time the user
sees, host time and all; periods over twice the window's median, where the user evaluated or
saved between two steps, left out) is kept. It measures again later, less often each time the
dense variant wins, as the model keeps getting sparser; and goes back to dense if the layers
densify.

Under CUDA graphs (``mode="reduce-overhead"``) each variant is its own compiled function with its
own recordings, so a switch records the other variant once (no recompile) and the TwELL variant
is recorded when its layers are sparse: the recorded path follows the density, at the cost of one
recording of each variant and the memory of both (docs/usage.md, "CUDA graphs").
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Callable, Optional

import torch

from . import lowering

# Steps each variant runs in a measurement, after the steps that warm it up (a first call
# compiles kernels or records a CUDA graph). Measured steps in which a kernel was compiled or
# tuned or a replayed call did its once-only work (``lowering.first_launches`` moved) are measured
# again, up to MEASURE_RETRIES times: on
# the H200 a 768-wide model's TwELL variant timed 316 ms a step with its first tuning inside the
# measurement and 75 ms without (docs/benchmarks.md, "Training from scratch").
MEASURE_STEPS = 8
WARMUP_STEPS = 3
MEASURE_RETRIES = 3
# A measured period over this many times the window's median held work between steps (an
# evaluation, a checkpoint): left out. A variant's own recurring cost stays in (the TwELL ops'
# L1 measurement every 8th call costs a 768-wide model's step ~1.3x; docs/design-notes.md).
OUTLIER_PERIOD = 2.0
# Steps between measurements while the dense variant wins: doubles after each win, up to the cap.
REMEASURE_STEPS = 200
REMEASURE_STEPS_MAX = 3200
# The share of the model's layers that must prefer the sparse path for the TwELL variant to be
# tried, and below which a model on the TwELL variant goes back to dense.
SPARSE_SHARE = 1 / 2
DENSE_SHARE = 1 / 4
# How often (steps) the dense variant's counters are copied to the host for the layers' policies.
WATCH_EVERY = 4
VARIANTS = ("dense", "twell")


def step_period(gaps: list[float]) -> float:
    """The mean of a window's step periods, less those over ``OUTLIER_PERIOD`` times its median."""
    limit = OUTLIER_PERIOD * statistics.median(gaps)
    kept = [g for g in gaps if g <= limit]
    return sum(kept) / len(kept)


class ModelVariants:
    """The variant all of one model's graphs (in one mode) run, chosen by measured step time."""

    def __init__(self, device: torch.device, training: bool, cuda_graphs: bool):
        self.device = device
        self.training = training
        self.cuda_graphs = cuda_graphs
        self.layers: dict[int, int] = {}  # layer id -> hidden
        self.clock: Optional[weakref.ref] = None  # the graph whose calls count the steps
        self.members = 0
        self.calls_since_clock = 0
        self.current = "dense"
        self.steps = 0
        self.next_check = 0
        self.wait = REMEASURE_STEPS
        self.trial: Optional[dict] = None
        self.periods: dict[str, float] = {}  # the last measurement (ms per step), for reports
        self.switches = 0

    def join(self, graph: "GraphVariants") -> None:
        self.layers.update(graph.layers)
        self.members += 1
        if self.clock is None or self.clock() is None:
            self.clock = weakref.ref(graph)

    def tick(self, graph: "GraphVariants") -> None:
        """A call of ``graph``: a step of the model if it is the clock (the graph that counts the
        steps: the first one, until it stops being called, as a graph replaced by a recompile)."""
        if self.clock is None or self.clock() is not graph:
            self.calls_since_clock += 1
            if self.calls_since_clock <= 2 * self.members:
                return
            self.clock = weakref.ref(graph)
        self.calls_since_clock = 0
        now = time.perf_counter()
        if self.trial is not None:
            self._measure(now)
        elif self.steps >= self.next_check:
            if self.current == "dense" and self._share_sparse() >= SPARSE_SHARE:
                self.trial = {"order": ["twell", "dense"], "periods": {}, "calls": 0, "last_tick": None,
                              "gaps": [], "launches": 0, "retries": 0}
                self._use("twell")
            elif self.current == "twell" and self._share_sparse() < DENSE_SHARE:
                self._use("dense")  # the model densified again
        self.steps += 1
        if self.current == "dense" and self.steps % WATCH_EVERY == 0:
            for layer, hidden in self.layers.items():
                lowering.watch_counters(layer, self.device, hidden)

    def share_sparse(self) -> float:
        """The share of the model's layers whose last measured call prefers the sparse path."""
        return self._share_sparse()

    def _share_sparse(self) -> float:
        if not self.layers:
            return 0.0
        votes = sum(lowering.prefers_sparse(layer, self.device, self.training, self.cuda_graphs) for layer in self.layers)
        return votes / len(self.layers)

    def _measure(self, now: float) -> None:
        trial = self.trial
        trial["calls"] += 1
        if trial["calls"] > WARMUP_STEPS + 1:
            trial["gaps"].append(now - trial["last_tick"])
        if trial["calls"] >= WARMUP_STEPS + 1:
            trial["last_tick"] = now
        if trial["calls"] == WARMUP_STEPS + 1:
            trial["gaps"], trial["launches"] = [], lowering.first_launches()
        if trial["calls"] < WARMUP_STEPS + 1 + MEASURE_STEPS:
            return
        if lowering.first_launches() != trial["launches"] and trial["retries"] < MEASURE_RETRIES:
            trial["retries"] += 1  # a kernel compiled or tuned in these steps: they warmed up, measure again
            trial["calls"] = WARMUP_STEPS + 1
            trial["gaps"], trial["launches"] = [], lowering.first_launches()
            return
        variant = trial["order"][len(trial["periods"])]
        trial["periods"][variant] = step_period(trial["gaps"])
        if len(trial["periods"]) < len(VARIANTS):
            trial["calls"], trial["retries"] = 0, 0
            self._use(trial["order"][len(trial["periods"])])
            return
        self.trial = None
        self.periods = {k: 1e3 * v for k, v in trial["periods"].items()}
        best = min(trial["periods"], key=trial["periods"].get)
        self._use(best)
        if best == "dense":
            self.next_check = self.steps + self.wait
            self.wait = min(2 * self.wait, REMEASURE_STEPS_MAX)
        else:
            self.next_check = self.steps + REMEASURE_STEPS

    def _use(self, variant: str) -> None:
        if variant != self.current:
            self.switches += 1
            self.current = variant


class GraphVariants:
    """What the backend returns for one graph: calls the variant its model runs now."""

    def __init__(self, dense: Callable, twell: Callable, layers: dict[int, int], model: ModelVariants):
        self.fns = {"dense": dense, "twell": twell}
        self.layers = layers
        self.model = model
        model.join(self)

    def __call__(self, *args):
        self.model.tick(self)
        return self.fns[self.model.current](*args)


_models: "dict[tuple, ModelVariants]" = {}


def model_variants(model_key, device: torch.device, training: bool, cuda_graphs: bool) -> ModelVariants:
    """The coordinator of one model's graphs in one mode (training or inference)."""
    key = (model_key, str(device), training, cuda_graphs)
    found = _models.get(key)
    if found is None:
        found = _models[key] = ModelVariants(device, training, cuda_graphs)
    return found


def coordinators() -> list[ModelVariants]:
    return list(_models.values())


def reset() -> None:
    _models.clear()
