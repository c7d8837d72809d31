"""What runs inside SGLang's processes (the worker and the scheduler it starts), not in kvflow's:
the worker process (`worker.py`), kvflow's SGLang plugin (`plugin.py`) and the hooks it installs
for evicted requests (`evict.py` and the modules it uses: `hooks`, `requests`, `compaction`,
`decode`, `extend`, `observing`, `tripwire`), the decode hook's in-graph step and its profile
(`graph.py`; `traffic.py` counts its bytes on meta tensors, `replay.py` is the CPU proxy for graph
replay) and kvflow's PRM model class (`prm_model.py`). kvflow's side reads `graph.Profile` only."""
