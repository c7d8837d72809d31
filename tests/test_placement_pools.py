"""SGLang's KV pool sizing replayed over every shipped pipeline's placement (issue 33).

SGLang 0.5.23 sizes an engine's KV pool as free memory after its weights minus free memory
at its start x (1 - mem_fraction_static) (`mem_cache/kv_cache_configurator.py`,
`_profile_available_bytes`): f x free-at-start - weights. Engines on one GPU start one after
the other, each seeing what the earlier ones left. Here that sequence is replayed with the
fractions kvflow passes (`Placement.placed_models`), on 1 x 80 GB and 8 x 80 GB, for every
shipped pipeline with a model on a GPU: every SGLang engine must get a positive pool, of the
size kvflow reports (`Placement.pools`). With the fractions passed through as written (kvflow
before issue 33), pipelines/sglang/kv_rescue.yaml's PRM got a negative pool on one GPU.
"""

from __future__ import annotations

import pytest
from conftest import REPO

from kvflow.config import load_pipeline
from kvflow.errors import UserError
from kvflow.planning.placement import PROCESS_OVERHEAD, place_pipeline
from kvflow.runtime.compile import used_models

GB = 80 * 10**9
SHIPPED = sorted(p for p in (REPO / "pipelines").rglob("*.yaml") if "sglang" in p.read_text())


def _replay(placement, models, starts):
    """Per SGLang model key: the pool SGLang 0.5.23 gives it, engines starting in `starts`
    order, each holding f x its free memory at start (weights + pool) and PROCESS_OVERHEAD."""
    placed = placement.placed_models(models)
    held = {i: 0.0 for i, _ in placement.gpus}
    totals = dict(placement.gpus)
    out = {}
    for d in _demands(models, starts):  # one per engine (entries that share one start it once)
        key = d.key
        idx = placement.assigned.get(key)
        if not idx:
            continue
        cfg = placed[key]
        if cfg.backend == "sglang":
            free = min(totals[i] - held[i] for i in idx)
            f = (cfg.engine or {}).get("mem_fraction_static", 0.9)
            pool = f * free - (d.weight_bytes or 0) / d.weight_shards
            out[key] = pool
            for i in idx:
                held[i] += f * free + PROCESS_OVERHEAD
        else:
            for i in idx:
                held[i] += d.claim(totals[i])
    return out


def _demands(models, keys):
    from kvflow.planning.placement import pipeline_demands

    return pipeline_demands(models, keys)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(REPO)) for p in SHIPPED])
@pytest.mark.parametrize("count", [1, 8])
def test_every_sglang_engine_gets_a_positive_pool_of_the_reported_size(path, count):
    loaded = load_pipeline(path)
    keys = used_models(loaded)
    models = loaded.pipeline.models
    if not any(models[k].backend == "sglang" for k in keys):
        pytest.skip("no SGLang engine")
    try:
        placement = place_pipeline(loaded, [(i, GB) for i in range(count)], keys)
    except UserError as e:  # a 72B on one GPU: refused before anything loads, which is right
        assert count == 1, e
        return
    pools = _replay(placement, models, keys)
    for key, pool in pools.items():
        assert pool > 0, (key, pool / 2**30)
        reported = placement.pools[key].pool_bytes
        assert reported is not None and abs(reported - pool) <= 1e-4 * GB, (key, reported, pool)


def test_kv_rescue_on_one_gpu_passes_fractions_of_what_is_free(tmp_path):
    """0.45 + 0.15 + 0.3 of one 80 GB GPU, started base -> helper -> PRM: each engine gets its
    share of the GPU (f x free at start = share x total), so the PRM's is 0.3 x 80 GB."""
    loaded = load_pipeline(REPO / "pipelines/sglang/kv_rescue.yaml")
    keys = used_models(loaded)
    placement = place_pipeline(loaded, [(0, GB)], keys)
    for key, share in (("base", 0.45), ("helper", 0.15), ("prm", 0.3)):
        pool = placement.pools[key]
        assert pool.share == share and abs(pool.passed * pool.free_at_start - share * GB) < 1e-3 * GB, (key, pool)
    assert placement.pools["prm"].passed > 0.3
    assert "mem_fraction_static" in "\n".join(placement.lines())
