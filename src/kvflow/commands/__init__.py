"""kvflow's commands, one module per command group; `kvflow.cli` only wires them into the Typer
app (the order `kvflow --help` lists them, the root options).

    common.py      exit codes and messages for kvflow's exceptions, the registry, shared help texts
    pipelines.py   validate, explain, schema: pipeline files, nothing run
    components.py  ls, plugins: what is installed
    run.py         run (and --sweep): pipelines into results directories
    results.py     report, view: tables, plots and the HTML viewer of results directories
    calibrate.py   calibrate, calibrate-bits: pruner thresholds and the quantized base's bit-width
    cost.py        cost: KV memory and FLOPs from models' shapes
    models.py      models pull / models ls: the model catalog

Layers: cli -> commands -> runtime (and config, eval, report, ...) -> components -> backends. A
command's heavy imports (torch, transformers, sglang, matplotlib) stay inside its function, so
`kvflow --help`, `validate`, `ls` and `plugins` import none of them. A new command goes in the
module of its group (or a new module here) and gets one line in kvflow/cli.py.
"""
