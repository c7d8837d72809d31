"""GPU placement for `device: auto` (kvflow.planning.placement; docs/backends.md "Placement on several
GPUs"), checked on stand-in device lists: no GPU, no model loaded, no network."""

from __future__ import annotations

import pytest
from conftest import REPO

from kvflow.config import load_pipeline
from kvflow.config.schema import ModelConfig
from kvflow.errors import UserError
from kvflow.planning.placement import (CAPACITY_SHARE, HF_HEADROOM, parse_gpus, pipeline_demands, place, place_pipeline)
from kvflow.runtime.compile import build_plan, place_models, used_models

GB = 10**9
PAPER_72B = REPO / "pipelines" / "sglang" / "gpu" / "kv_rescue_72b.yaml"


def gpus(count: int, size_gb: float = 80) -> list[tuple[int, int]]:
    return [(i, int(size_gb * GB)) for i in range(count)]


def place_models_of(models: dict[str, ModelConfig], devices):
    """The rule over every entry of `models` (all of them used)."""
    return place(pipeline_demands(models, list(models)), devices)


def hf(name: str, size: str, **kw) -> ModelConfig:
    """An hf entry whose size the rule reads from its id (a hub id in no local cache); entries
    with equal settings are one engine, so each test model has its own `name`."""
    return ModelConfig(id=f"kvflow-test/{name}-{size}", **kw)


def fields(excinfo) -> list[str]:
    return [p.path for p in excinfo.value.problems]


# --------------------------------------------------------------------------- the paper's 72B pipeline


def test_the_72b_pipeline_fits_an_8x80_node_base_on_gpus_0_to_3_helper_and_prm_alone():
    loaded = load_pipeline(PAPER_72B)
    placement = place_pipeline(loaded, gpus(8), used_models(loaded))
    assert placement.assigned["base"] == (0, 1, 2, 3)  # tensor parallel first, on consecutive GPUs
    helper, prm = placement.assigned["helper"], placement.assigned["prm"]
    assert len(helper) == len(prm) == 1 and helper != prm and not {*helper, *prm} & {0, 1, 2, 3}
    for i, claims in placement.claims.items():  # each GPU holds its claims, the base alone on its four
        assert sum(claims.values()) <= CAPACITY_SHARE * 80 * GB
        assert i >= 4 or list(claims) == ["base"]
    assert placement.claims[0]["base"] == pytest.approx(0.85 * 80 * GB)  # mem_fraction_static x total
    prm_params = 7e9  # no config in the cache: the "7B" in Qwen2.5-Math-PRM-7B
    assert placement.claims[prm[0]]["prm"] == pytest.approx(prm_params * 2 * HF_HEADROOM, rel=0.1)


def test_the_72b_pipeline_on_4x80_is_refused_naming_the_fields():
    loaded = load_pipeline(PAPER_72B)
    with pytest.raises(UserError) as excinfo:
        place_pipeline(loaded, gpus(4), used_models(loaded))
    assert set(fields(excinfo)) == {"models.helper.engine.mem_fraction_static", "models.prm.device"}
    text = str(excinfo.value)
    assert "0.85 (models.base) + 0.5 (models.helper) = 1.35" in text  # the numbers, and a hint
    assert "hint:" in text and "kv_rescue_72b.yaml" in text


def test_kvflow_run_places_before_any_engine_starts_and_refuses_what_cannot_fit():
    """build_plan places first: on 4 GPUs nothing is loaded; on 8 the engines are asked for the
    placed entries (device cuda:i, and SGLang's base_gpu_id) while the run's hash is unchanged."""
    loaded = load_pipeline(PAPER_72B)
    asked = []

    class Backend:
        def load(self, model_cfg):
            asked.append(model_cfg)
            raise UserError("stop here: no model is loaded in this test")

    class Registry:
        def get(self, kind, name):
            return Backend()

    with pytest.raises(UserError) as excinfo:
        build_plan(loaded, Registry(), gpus=gpus(4))
    assert "models.prm.device" in fields(excinfo) and asked == []
    with pytest.raises(UserError, match="stop here"):
        build_plan(loaded, Registry(), gpus=gpus(8))
    assert asked[0].id == "Qwen/Qwen2.5-Math-72B-Instruct"
    assert asked[0].device == "cuda:0" and asked[0].engine["base_gpu_id"] == 0 and asked[0].engine["tp_size"] == 4
    placed, placement = place_models(loaded, gpus(8))
    assert placed.pipeline.models["helper"].engine["base_gpu_id"] == placement.assigned["helper"][0] >= 4
    assert placed.pipeline.models["prm"].device == f"cuda:{placement.assigned['prm'][0]}"
    assert placed.hash == loaded.hash and "base_gpu_id" not in str(placed.resolved)


@pytest.mark.parametrize("path", sorted((REPO / "pipelines").rglob("*.yaml")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_pipeline_fits_an_8x80_node(path):
    loaded = load_pipeline(path)
    place_pipeline(loaded, gpus(8), used_models(loaded))


# --------------------------------------------------------------------------- the rule


def test_hf_models_that_fit_together_share_a_gpu():
    placement = place_models_of({"a": hf("a", "7B"), "b": hf("b", "7B")}, gpus(1))  # 2 x 16.8 GB of 76
    assert placement.assigned == {"a": (0,), "b": (0,)}
    assert sum(placement.claims[0].values()) == pytest.approx(2 * 7e9 * 2 * HF_HEADROOM)


def test_models_go_to_the_emptiest_gpu_and_share_only_where_there_is_room():
    # 48 GB + 16.8 + 16.8 on 2 x 80: the big one alone, the two small ones together
    placement = place_models_of({"small": hf("small", "7B"), "big": hf("big", "20B"), "small2": hf("small2", "7B")}, gpus(2))
    assert placement.assigned == {"big": (0,), "small": (1,), "small2": (1,)}


def test_hf_models_that_do_not_fit_together_are_split_or_refused():
    models = {"a": hf("a", "20B"), "b": hf("b", "20B")}  # 48 GB each: not two on one 80 GB GPU
    assert place_models_of(models, gpus(2)).assigned == {"a": (0,), "b": (1,)}
    with pytest.raises(UserError) as excinfo:
        place_models_of(models, gpus(1))
    assert fields(excinfo) == ["models.b.device"]
    assert "is asked for 89.4 GiB" in str(excinfo.value)  # 2 x 20e9 x 2 bytes x 1.2 = 96e9 bytes


def test_an_explicit_device_is_honoured_and_counted():
    models = {"pinned": hf("pinned", "20B", device="cuda:1"), "free": hf("free", "20B")}
    placement = place_models_of(models, gpus(2))
    assert placement.assigned == {"pinned": (1,), "free": (0,)}  # the rule steers around it
    with pytest.raises(UserError) as excinfo:  # two pinned where they do not fit: refused, not moved
        place_models_of({"a": hf("a", "20B", device="cuda:1"), "b": hf("b", "20B", device="cuda:1")}, gpus(2))
    assert fields(excinfo) == ["models.b.device"]
    with pytest.raises(UserError, match="asks for GPU 3, but this machine has GPUs 0-1") as excinfo:
        place_models_of({"a": hf("a", "7B", device="cuda:3")}, gpus(2))
    assert fields(excinfo) == ["models.a.device"]


def test_sglang_fractions_over_the_share_on_one_gpu_are_refused():
    def engine(name, fraction, **kw):  # each its own checkpoint: entries with equal settings are one engine
        return ModelConfig(backend="sglang", id=f"kvflow-test/{name}-1B", engine={"mem_fraction_static": fraction}, **kw)

    ok = place_models_of({"a": engine("a", 0.5), "b": engine("b", 0.4)}, gpus(1))  # 0.9: fits
    assert ok.assigned == {"a": (0,), "b": (0,)}
    with pytest.raises(UserError) as excinfo:
        place_models_of({"a": engine("a", 0.5), "b": engine("b", 0.5)}, gpus(1))  # 1.0 > 0.95
    assert fields(excinfo) == ["models.b.engine.mem_fraction_static"]
    assert "0.5 (models.a) + 0.5 (models.b) = 1.00" in str(excinfo.value)
    pinned = ModelConfig(backend="sglang", id="kvflow-test/engine-1B", device="cuda:1",  # base_gpu_id wins
                         engine={"mem_fraction_static": 0.6, "base_gpu_id": 0})
    with pytest.raises(UserError) as excinfo:  # pinned to one GPU by device and base_gpu_id: the same check
        place_models_of({"a": engine("a", 0.6, device="cuda:0"), "b": pinned}, gpus(2))
    assert fields(excinfo) == ["models.b.engine.mem_fraction_static"]
    assert place_models_of({"a": engine("a", 0.6), "b": pinned}, gpus(2)).assigned == {"b": (0,), "a": (1,)}


def test_an_sglang_fraction_too_small_for_its_weights_is_refused():
    base = ModelConfig(backend="sglang", id="kvflow-test/big-72B", engine={"tp_size": 4, "mem_fraction_static": 0.4})
    with pytest.raises(UserError, match="of weights per GPU") as excinfo:  # 36 GB of weights per GPU > 32 GB
        place_models_of({"base": base}, gpus(4))
    assert fields(excinfo) == ["models.base.engine.mem_fraction_static"]
    awq = base.model_copy(update={"id": "kvflow-test/big-72B-AWQ"})  # 4-bit weights: not params x 2 bytes
    assert place_models_of({"base": awq}, gpus(4)).assigned == {"base": (0, 1, 2, 3)}
    with pytest.raises(UserError, match="needs 4 GPUs") as excinfo:
        place_models_of({"base": base}, gpus(2))
    assert fields(excinfo) == ["models.base.engine.tp_size"]


def test_entries_of_one_engine_are_placed_once():
    same = hf("shared", "20B")
    placement = place_models_of({"base": same, "helper": same}, gpus(1))  # one copy of the weights: 48 GB
    assert placement.assigned == {"base": (0,), "helper": (0,)} and list(placement.claims[0]) == ["base"]


def test_without_gpus_nothing_is_placed_and_auto_stays_the_cpu():
    loaded = load_pipeline(PAPER_72B)
    same, placement = place_models(loaded, [])
    assert same is loaded and placement is None
    assert {m.device for m in same.pipeline.models.values()} == {"auto"}
    assert place_models_of({"a": hf("a", "200B")}, []).assigned == {}  # nothing to check either
    cpu = place_models_of({"a": hf("a", "200B", device="cpu"), "b": hf("b", "7B")}, gpus(1))
    assert cpu.assigned == {"b": (0,)}  # an explicit cpu is not placed, not counted


def test_gpu_lists_for_explain():
    assert parse_gpus("8x80") == gpus(8)
    assert parse_gpus("80, 24GiB") == [(0, 80 * GB), (1, 24 * 2**30)]
    with pytest.raises(UserError):
        parse_gpus("8x")


def test_explain_shows_the_placement(tmp_path):
    from kvflow.tools.explain import explain_command

    lines: list[str] = []
    explain_command(PAPER_72B, gpus="8x80", echo=lines.append)
    text = "\n".join(lines)
    assert "placement on 8 GPUs" in text and "models.base: GPUs 0-3" in text
    lines.clear()
    explain_command(PAPER_72B, gpus="4x80", echo=lines.append)
    assert "does not fit" in "\n".join(lines) and "models.prm.device" in "\n".join(lines)


def test_kvflow_run_asks_this_machine_for_its_gpus(monkeypatch):
    """`place_models(loaded)` (what build_plan and the manifest use) reads the GPUs from torch:
    none here (a CPU machine) leaves every entry as written; a stand-in list places them."""
    import kvflow.planning.placement

    loaded = load_pipeline(PAPER_72B)
    monkeypatch.setattr(kvflow.planning.placement, "cuda_devices", lambda: gpus(8))
    placed, placement = place_models(loaded)
    assert placed.pipeline.models["base"].device == "cuda:0" and placement.to_dict()["models"]["base"]["gpus"] == [0, 1, 2, 3]
    monkeypatch.setattr(kvflow.planning.placement, "cuda_devices", lambda: [])
    assert place_models(loaded) == (loaded, None)
