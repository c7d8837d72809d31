"""`confidence`: stops candidates the model writes without confidence (DeepConf's token confidence).

DeepConf ("Deep Think with Confidence", Fu, Wang, Tian and Zhao, 2025,
https://arxiv.org/abs/2508.15260) stops a reasoning trace online once its confidence drops:
the *token confidence* C_i = -(1/k) * sum of the k largest log-probabilities at token i (k = 20)
is high where the model's distribution is peaked and low where it is flat; the *group
confidence* is C_i averaged over a sliding window of tokens, and DeepConf-online ends a trace
as soon as the group confidence of its newest window falls below a threshold set on warm-up
traces (its *lowest group confidence*; the *tail confidence* averages the trace's last tokens).

Signal, over the candidate's step so far (`trace.confidences`, k = `CONFIDENCE_TOP_K` = 20,
the model's temperature-1 distribution, exact on every built-in engine), by `mode`:

- `tail` (default): the mean of the last `window` tokens: the newest group's confidence,
  DeepConf-online's stopping statistic;
- `lowest_group`: the lowest mean over every window of `window` consecutive tokens of the
  step so far (DeepConf's lowest group confidence); it never rises, so it stops the same
  candidates as `tail` once both are checked from the first full window on, and its recorded
  trace is what `kvflow calibrate` should see for a threshold on the lowest group;
- `mean`: the mean over the whole step (DeepConf's average trace confidence, per step).

A window shorter than `window` tokens (a step shorter than it) is the whole step. Flags a
candidate once it has `min_tokens` tokens and the signal is below `threshold`.

Defaults. DeepConf's groups are 2048 tokens over traces of tens of thousands; a kvflow step is
a few dozen to a few hundred tokens (the CPU reproduction caps steps at 192), so a group here
is 32 tokens, the window of `entropy`, checked from the 32nd token on (a swap between the two
compares signals, not windows). On Qwen2.5-Coder-0.5B-Instruct (teacher-forced, temperature 1,
the pruner contract's texts), 32-token windows of a coherent GSM8K solution had confidences of
7.35 to 11.25, its own greedy text 10.1 to 12.2, a repetition loop 7.2 to 12.2 and gibberish
4.0 to 7.2; 16-token windows overlapped between coherent text and gibberish. The default
threshold 5.0 stops the flat, gibberish-like mode and nothing coherent; loops stay well above
it and are `gzip`'s to stop. Calibrate it for a model with `kvflow calibrate` (direction: low),
and check the proposal: on the CPU reproduction's calibration split the valley fell between
two modes of coherent and looping text (docs/reproduction.md#confidence-calibration).

Shapes: trace.confidences [rows, max_step_tokens], trace.n_tokens [rows] -> [rows] bool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Pruner, PrunerParams


class ConfidenceParams(PrunerParams):
    mode: Literal["tail", "lowest_group", "mean"] = Field(
        "tail", description="tail: mean confidence of the last `window` tokens (DeepConf-online's group); "
        "lowest_group: lowest such mean over the step so far; mean: mean over the whole step.")
    window: int = Field(32, ge=1, description="Tokens per group (DeepConf's group size; 2048 there, for whole traces).")
    threshold: float = Field(5.0, gt=0, description="Confidence (minus the mean top-20 log-probability, nats) "
                                                    "below which a candidate is stopped.")
    min_tokens: int = Field(32, ge=1, description="No check before this many tokens.")


class ConfidencePruner(Pruner):
    """DeepConf group confidence (mean of -mean top-20 logprob over `window` tokens) below `threshold`."""

    Params = ConfidenceParams
    signal_name = "group_confidence"
    needs_text = False
    trace_fields = ("confidences",)

    def signal(self, trace):
        if trace.confidences is None:
            raise ValueError("confidence: this StepTrace has no `confidences` (engines fill them; a trace built "
                             "by hand must pass confidences=[rows, T] float32)")
        p = self.params
        counts = trace.n_tokens.to(trace.confidences.device)  # [rows]
        rows, width = trace.confidences.shape
        # prefix sums in float64 (a row's sums do not depend on the other rows or on rounding order)
        cs = torch.nn.functional.pad(trace.confidences.double().cumsum(-1), (1, 0))  # [rows, T + 1]
        n = counts.clamp(min=1, max=width)  # [rows]
        if p.mode == "mean":
            value = cs.gather(1, n[:, None])[:, 0] / n
        else:
            w = n.clamp(max=p.window)  # [rows]: a step shorter than the window is one group
            ends = torch.arange(1, width + 1, device=cs.device)[None, :]  # [1, T]: exclusive ends
            starts = ends - w[:, None]  # [rows, T]
            groups = (cs[:, 1:] - cs.gather(1, starts.clamp(min=0))) / w[:, None]  # [rows, T]: mean ending there
            if p.mode == "tail":
                value = groups.gather(1, (n - 1)[:, None])[:, 0]
            else:  # lowest_group: over the windows that lie inside the step so far
                inside = (starts >= 0) & (ends <= n[:, None])
                value = groups.masked_fill(~inside, float("inf")).amin(-1)
        value = value.float()
        return value.masked_fill(counts < max(p.min_tokens, 1), float("nan"))  # [rows]

    def check(self, trace):
        return self.signal(trace) < self.params.threshold  # nan compares False
