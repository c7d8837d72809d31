"""kvflow's results, as a format: what a run writes and every reader reads.

- `files.py`    the results directory (`samples.jsonl`, `metrics.json`, `manifest.json`,
                `config.resolved.yaml`): writing it safely (`ResultsDir`), reading and checking
                it, and the metrics computed from its samples;
- `runs.py`     `Run`: one results directory loaded for comparison (`report`, `view`);
- `signals.py`  the early-stop signals: directions, pruner names and thresholds;
- `stats.py`    Wilson intervals and the exact McNemar test.

The runtime writes results (`kvflow.runtime`); `report`, `view` and `calibrate` read them.
"""
