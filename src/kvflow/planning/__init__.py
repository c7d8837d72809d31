"""From a pipeline's models to GPUs: what each engine asks of them (`demands.py`, each backend
saying how its engine occupies GPUs: `Backend.gpu_layout`) and where each goes (`placement.py`)."""
