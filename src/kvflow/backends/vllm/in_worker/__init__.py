"""What runs inside the vLLM worker process, in vLLM's own environment (kvflow is imported there
from kvflow's import path, appended after vLLM's packages): the worker (`worker.py`, run by its
path) and kvflow's evicted requests inside it (`evict.py`)."""
