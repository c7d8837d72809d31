"""`GET /metrics` of `kvflow serve`: counters, gauges and histograms in Prometheus' text format
(version 0.0.4), kept by the app (requests by endpoint and status) and the engine thread
(tokens, steps, pruned candidates, latencies). Thread-safe; no dependency.

    kvflow_requests_total{endpoint, status}            counter
    kvflow_requests_cancelled_total                     counter (clients gone before the end)
    kvflow_requests_in_flight / kvflow_requests_queued  gauges (admitted / waiting for room)
    kvflow_tokens_generated_total{proposer}             counter (every candidate's tokens)
    kvflow_committed_steps_total{source}                counter
    kvflow_pruned_candidates_total{pruner}              counter
    kvflow_decode_rows{engine}                          gauge (candidate rows queued or decoding)
    kvflow_decode_occupancy{engine}                     gauge (mean rows per forward / bound, since start)
    kvflow_engine_up                                    gauge (0 once an engine died)
    kvflow_time_to_first_step_seconds                   histogram
    kvflow_request_seconds                              histogram (until the answer's end)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Optional

COMPLETIONS = ("/v1/chat/completions", "/v1/completions")  # the endpoints the progress line counts

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.total, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


def _labels(**kv: str) -> str:
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kv.items()) + "}"


class Metrics:
    """What /metrics reports; `gauges()` is called at each scrape for the engine's live figures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.steps: dict[str, int] = defaultdict(int)
        self.pruned: dict[str, int] = defaultdict(int)
        self.first_step = Histogram()
        self.latency = Histogram()
        self.cancelled = 0
        self.answer_tokens = 0  # committed tokens sent to clients (the progress line's rate)
        self.gauges: Callable[[], dict] = lambda: {}

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def step(self, source: str, tokens: int = 0) -> None:
        """A committed step sent to its client: `tokens` of its answer."""
        with self.lock:
            self.steps[source] += 1
            self.answer_tokens += tokens

    def finished(self, tokens: dict, pruned: dict, cancelled: bool = False) -> None:
        with self.lock:
            self.cancelled += int(cancelled)
            for k, v in tokens.items():
                self.tokens[k] += v
            for k, v in pruned.items():
                self.pruned[k] += v

    def observe(self, first_step: float | None, total: float | None) -> None:
        with self.lock:
            if first_step is not None:
                self.first_step.observe(first_step)
            if total is not None:
                self.latency.observe(total)

    def progress(self, since: "tuple[float, int, int] | None", clock: float) -> "tuple[Optional[str], tuple]":
        """The server's progress line since the snapshot `since` (clock, answered, answer tokens
        committed), or None when nothing happened then; and the new snapshot. `clock`:
        time.monotonic() now. The rate counts committed answer tokens as their steps are sent
        (candidates' tokens are counted when a request ends: /metrics)."""
        g = self.gauges()
        with self.lock:
            answers = [(status, n) for (endpoint, status), n in self.requests.items() if endpoint in COMPLETIONS]
            answered = sum(n for status, n in answers if status < 400)
            failed = sum(n for status, n in answers if status >= 400)
            tokens = self.answer_tokens
        snapshot = (clock, answered + failed, tokens)
        in_flight, queued = g.get("in_flight", 0), g.get("queued", 0)
        if since is not None and snapshot[1:] == since[1:] and not in_flight and not queued:
            return None, snapshot
        rate = ""
        if since is not None and clock > since[0]:
            rate = f", {(tokens - since[2]) / (clock - since[0]):.1f} tok/s over the last {clock - since[0]:.0f} s"
        line = (f"{answered} requests answered" + (f", {failed} refused or failed" if failed else "")
                + f", {in_flight} in flight, {queued} queued; {tokens} answer tokens committed{rate}")
        return line, snapshot

    def text(self) -> str:
        g = self.gauges()
        out: list[str] = []

        def family(name: str, kind: str, doc: str) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")

        with self.lock:
            family("kvflow_requests_total", "counter", "HTTP requests answered, by endpoint and status.")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"kvflow_requests_total{_labels(endpoint=endpoint, status=str(status))} {n}")
            family("kvflow_requests_cancelled_total", "counter", "Requests whose client went away before the end.")
            out.append(f"kvflow_requests_cancelled_total {self.cancelled}")
            family("kvflow_requests_in_flight", "gauge", "Requests decoding on the step scheduler.")
            out.append(f"kvflow_requests_in_flight {g.get('in_flight', 0)}")
            family("kvflow_requests_queued", "gauge", "Requests waiting for room.")
            out.append(f"kvflow_requests_queued {g.get('queued', 0)}")
            family("kvflow_tokens_generated_total", "counter", "Tokens generated by each proposer (every candidate).")
            for k, n in sorted(self.tokens.items()):
                out.append(f"kvflow_tokens_generated_total{_labels(proposer=k)} {n}")
            family("kvflow_committed_steps_total", "counter", "Committed steps by source proposer.")
            for k, n in sorted(self.steps.items()):
                out.append(f"kvflow_committed_steps_total{_labels(source=k)} {n}")
            family("kvflow_pruned_candidates_total", "counter", "Candidates stopped by each pruner.")
            for k, n in sorted(self.pruned.items()):
                out.append(f"kvflow_pruned_candidates_total{_labels(pruner=k)} {n}")
            family("kvflow_decode_rows", "gauge", "Candidate rows queued or decoding, per engine.")
            for k, n in sorted(g.get("rows", {}).items()):
                out.append(f"kvflow_decode_rows{_labels(engine=k)} {n}")
            family("kvflow_decode_occupancy", "gauge", "Mean decode rows per forward over the row bound, since start.")
            for k, occ in sorted(g.get("occupancy", {}).items()):
                out.append(f"kvflow_decode_occupancy{_labels(engine=k)} {occ}")
            family("kvflow_engine_up", "gauge", "1 while every engine is alive, 0 once one died.")
            out.append(f"kvflow_engine_up {0 if g.get('dead') else 1}")
            for name, h, doc in (("kvflow_time_to_first_step_seconds", self.first_step,
                                  "From a request's arrival to its first committed step."),
                                 ("kvflow_request_seconds", self.latency, "From a request's arrival to its answer's end.")):
                family(name, "histogram", doc)
                for bound, n in zip(BUCKETS, h.counts):
                    out.append(f"{name}_bucket{_labels(le=repr(bound))} {n}")
                out.append(f"{name}_bucket{_labels(le='+Inf')} {h.n}")
                out.append(f"{name}_sum {h.total:.6f}")
                out.append(f"{name}_count {h.n}")
        return "\n".join(out) + "\n"
