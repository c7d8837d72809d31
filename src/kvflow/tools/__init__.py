"""What kvflow's commands compute beyond running a pipeline, one module each:

- `explain.py`        a pipeline's compiled plan in words (`kvflow explain`), no model loaded;
- `sweep.py`          grids of runs over pipeline fields (`kvflow run --sweep`, `sweep:` mappings);
- `calibrate.py`      early-stop thresholds from a run's recorded signals (`kvflow calibrate`);
- `calibrate_bits.py` bit widths for a quantized cache (`kvflow calibrate-bits`);
- `doctor.py`         what this machine's engines can run (`kvflow doctor`);
- `cost.py`           KV memory and FLOPs of evicted and full-KV models from their shapes (`kvflow cost`);
- `json_schema.py`    the JSON Schema of pipeline files with the installed components (`kvflow schema`).

The CLI's command modules (`kvflow.commands`) parse arguments and call these.
"""
