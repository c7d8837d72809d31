"""Pydantic models of a pipeline file (DESIGN.md §5).

Every model is frozen and forbids unknown fields. Component entries (`evictor`, `pruners`,
`scorer`, `committer`) are validated in two passes: here only `kind` is checked for shape;
`kvflow.config.validate` then looks the kind up in the plugin registry and validates the
remaining keys against that component's own `Params` model, so third-party parameters get
exactly the same checks and error messages as built-in ones.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ComponentRef(BaseModel):
    """`{kind: name, **params}`: which registered component, and its raw parameters."""

    model_config = ConfigDict(frozen=True, extra="allow")
    kind: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DatasetFields(Frozen):
    question: str = Field("question", description="Field holding the problem text.")
    answer: str = Field("answer", description="Field holding the gold answer.")
    id: Optional[str] = Field(None, description="Field holding a problem id (default: the line index).")


class DatasetConfig(Frozen):
    name: str = Field("gsm8k", description="Built-in dataset name (gsm8k, math500, ...), or the name of a `path` dataset.")
    path: Optional[str] = Field(None, description="A JSONL file (relative to the pipeline file) instead of a built-in dataset.")
    fields: DatasetFields = Field(default_factory=DatasetFields, description="Field mapping of a `path` dataset.")
    limit: Optional[int] = Field(None, ge=1, description="Use only the first `limit` problems (after offset/shuffle).")
    offset: int = Field(0, ge=0, description="Skip this many problems first.")
    shuffle: bool = Field(False, description="Shuffle with `run.seed` before offset/limit.")
    prompt: str = Field("qwen25-math-cot", description="Prompt template name.")


class ModelConfig(Frozen):
    backend: str = Field("hf", min_length=1, description="Inference engine: a registered backend (`kvflow ls backends`).")
    id: str = Field(..., description="Hub id, local directory, .gguf path, or catalog:<name>.")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    gguf_file: Optional[str] = Field(None, description="GGUF file inside a hub repo or directory.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer source when it differs from `id`.")
    trust_remote_code: bool = Field(False, description="Allow the checkpoint's own Python code. Off unless asked.")
    revision: Optional[str] = None
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine settings passed to the backend as they are: SGLang's server arguments on "
        "`backend: sglang` (tp_size, dp_size, mem_fraction_static, attention_backend, context_length, ...); "
        "vLLM's engine arguments on `backend: vllm` (max_model_len, kv_cache_memory_bytes, tensor_parallel_size, "
        "...); none on `hf`.")

    @field_validator("id", "tokenizer")
    @classmethod
    def _known_catalog_name(cls, value: Optional[str]) -> Optional[str]:
        """A `catalog:` name is checked here, not only when the model loads: `kvflow validate`
        refuses an unknown one as `kvflow run` does (the catalog is a table, no download)."""
        if value is not None and value.startswith("catalog:"):
            from kvflow.models.catalog import CatalogError, get_entry

            try:
                get_entry(value)
            except CatalogError as e:
                raise ValueError(e.message) from None
        return value


class SamplingConfig(Frozen):
    temperature: float = Field(0.7, ge=0.0, description="0 means greedy.")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_step_tokens: int = Field(512, ge=1, description="A candidate step is cut here (finish `max_step_tokens`).")


class ProposerConfig(Frozen):
    model: str = Field(..., description="Key into `models`.")
    n: int = Field(1, ge=1, description="Candidates per problem per step.")
    sampling: SamplingConfig = SamplingConfig()
    evictor: ComponentRef = Field(default_factory=lambda: ComponentRef(kind="none"))
    pruners: list[ComponentRef] = Field(default_factory=list)


class LimitsConfig(Frozen):
    max_steps: int = Field(256, ge=1, description="Committed steps per problem before the cap.")
    max_tokens: int = Field(4096, ge=1, description="Committed tokens (base tokenizer) per problem before the cap.")
    stop_on_answer: bool = Field(False, description="End a trajectory once a committed step contains \\boxed{...}.")
    on_all_pruned: Literal["fallback", "stop"] = Field(
        "fallback",
        description="When every candidate of a problem was pruned: commit the best-scored pruned "
        "candidate (its text up to where it was stopped) and mark the step `fallback`, or end the "
        "trajectory with finish `pruned`.",
    )


class BaselinesConfig(Frozen):
    full: str = Field(..., description="Results directory of the full-KV baseline run (acc_full).")
    evicted: str = Field(..., description="Results directory of the evicted baseline run (acc_evicted).")


class RunConfig(Frozen):
    seed: int = 0
    batch_problems: int = Field(16, ge=1, description="Decode room per model, in problems: a model's forward "
                                "decodes at most batch_problems x (candidates per problem on it) rows. With run.kv_memory, only where set.")
    live_problems: Optional[int] = Field(
        None, ge=1, description="Problems in flight at once (each holds its cache states); unset: 2 x "
        "batch_problems, so that decode rows stay busy while some problems score, sync or wait for another model "
        "(with run.kv_memory: no count bound).")
    kv_memory: Optional[Union[int, str]] = Field(
        None, description="KV bytes for the rows of every problem in flight (`2GiB`, `512MiB`, an int, or `auto`: "
        "half the RAM available on a CPU, 0.9 of the GPU memory free after the weights): a problem is admitted only "
        "while its rows fit beside the others' (evicted rows cost budget + buffer, full-context rows prompt + "
        "limits.max_tokens), and batch_problems / live_problems then bound only where set. Unset: admission by "
        "count. Results do not depend on it (docs/memory.md#admission-by-kv-memory).")
    output: str = Field("results", description="Parent directory of results directories.")
    delimiter: str = Field("\n\n", min_length=1, description="Step delimiter.")
    grade_timeout: float = Field(10.0, gt=0, description="Seconds before a grading call counts as wrong.")
    threads: Optional[int] = Field(
        None, ge=1, description="Torch CPU threads during the run (restored after it); unset: torch's default "
        "(OMP_NUM_THREADS). On a small shared CPU one thread can be several times faster (docs/benchmarks.md).")
    record_signals: bool = Field(False, description="Record every candidate's per-token pruner signals in samples.jsonl (for `kvflow calibrate`).")
    record_candidates: bool = Field(
        False, description="Record every candidate of every step in samples.jsonl (`all_candidates`: text, source, "
        "score, finish, tokens, whether committed), not only the committed ones, for `kvflow view`. Costs about "
        "the text of all N candidates per step: docs/results.md has a measurement.")
    deterministic: bool = Field(
        False, description="Batch-invariant decoding: a problem's trajectory does not depend on which problems "
        "share its forwards. On `hf` (CPU and GPU) kvflow's batch-invariant forwards (linear layers in fixed-size "
        "tiles, attention row by row; slower: docs/benchmarks.md#batch-invariant-hf) under torch's deterministic "
        "algorithms; on SGLang its `enable_deterministic_inference` and on vLLM its `VLLM_BATCH_INVARIANT` mode, "
        "both on a GPU only (refused on a CPU).")
    overlap_engines: Literal["auto", "on", "off"] = Field(
        "auto", description="Let models decode at once: each in-process model (hf) steps on a thread of its own "
        "and SGLang's streamed tokens are read (pruners, stop rules) while the other forwards run. `auto`: when an "
        "engine streams (SGLang) or the in-process models sit on distinct GPUs; on one CPU they would only share "
        "its cores. Results do not depend on it (docs/concepts.md).")
    baselines: Optional[BaselinesConfig] = Field(
        None, description="Results directories whose metrics.json give recovery = (acc - acc_evicted) / (acc_full - acc_evicted).")
    # where the problems are decoded (docs/cluster.md): not part of the run's hash, so a run
    # started on one executor resumes on the other
    executor: Literal["local", "ray"] = Field(
        "local", description="Where problems are decoded: `local` (this process) or `ray` (kvflow workers on a Ray "
        "cluster, each with its own engines; the cluster from `--ray-address` or RAY_ADDRESS, else a local one). The "
        "results directory is the same either way (docs/cluster.md).")
    workers: Optional[int] = Field(
        None, ge=1, description="Ray workers (`executor: ray`); unset: as many as the cluster's GPUs hold at "
        "`worker_gpus` each (without GPUs: its CPUs at `threads` or 1 each), at most one per problem.")
    worker_gpus: Optional[int] = Field(
        None, ge=0, description="GPUs per Ray worker (`executor: ray`); unset: one per GPU the pipeline's engines "
        "occupy (each distinct model entry 1, SGLang tp_size x dp_size x pp_size), 0 on a cluster without GPUs.")


    @field_validator("kv_memory")
    @classmethod
    def _byte_size(cls, value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
        """`auto`, or a byte size kept as written (its bytes: `kvflow.kv_memory.parse_bytes`)."""
        from kvflow.kv_memory import parse_bytes

        if value is None or value == "auto":
            return value
        parse_bytes(value)
        return value


#: request fields a pipeline decides (its proposers' sampling, one answer per request, no tools):
#: `kvflow serve` refuses a request that sets one (400 naming it) unless `serve.ignore` lists it
SERVE_IGNORABLE = ("temperature", "top_p", "n", "tools", "tool_choice", "response_format", "presence_penalty",
                   "frequency_penalty", "logit_bias")


class ServeConfig(Frozen):
    """How `kvflow serve` answers requests (docs/serve.md). None of it changes a trajectory."""

    ignore: list[str] = Field(
        default_factory=list,
        description="Request fields accepted and ignored instead of refused with a 400: any field name (the "
        "sampling fields the pipeline decides, or fields other servers accept such as top_k, "
        "repetition_penalty, store), or \"*\" for every field kvflow serve does not honour. E.g. "
        "[temperature, top_p] for evaluation harnesses that send `temperature: 0` by default.")
    clamp_max_tokens: bool = Field(
        False, description="A request's max_tokens above limits.max_tokens is lowered to it (the response says so "
        "in an X-Kvflow-Max-Tokens-Clamped header) instead of refused with a 400.")
    queue: int = Field(64, ge=0, description="Requests that may wait for room beyond the problems in flight "
                       "(run.live_problems); past it a request gets 429 with Retry-After.")
    retry_after: int = Field(1, ge=1, description="Seconds a 429 or 503 response's Retry-After header asks for.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body; larger ones get 413.")
    max_prompt_tokens: Optional[int] = Field(
        None, ge=1, description="Longest prompt in base-model tokens (chat template applied); unset: the base "
        "model's context length minus limits.max_tokens. Longer prompts get 400.")
    seed_by: Literal["request", "dataset"] = Field(
        "request", description="What seeds a request's rows. `request`: its `seed` (a request with `seed: i` is "
        "seeded as `kvflow run` seeds problem `<dataset.name>/<i>`), else its id. `dataset`: a request whose "
        "question (its last user message, or its prompt) is a question of the pipeline's dataset is seeded as "
        "`kvflow run` seeds that problem, whatever `seed` it sends (said in X-Kvflow-Ignored), so that an "
        "evaluation harness that sends one seed for every request (lm-eval: 1234) gets `kvflow run`'s answers "
        "problem by problem (with run.deterministic; docs/serve.md).")


class Pipeline(Frozen):
    kvflow: Literal[1] = Field(1, description="Pipeline file format version.")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    dataset: DatasetConfig = DatasetConfig()
    models: dict[str, ModelConfig]
    proposers: dict[str, ProposerConfig]
    scorer: ComponentRef = Field(default_factory=lambda: ComponentRef(kind="likelihood"))
    committer: ComponentRef = Field(default_factory=lambda: ComponentRef(kind="best"))
    limits: LimitsConfig = LimitsConfig()
    run: RunConfig = RunConfig()
    serve: ServeConfig = Field(default_factory=ServeConfig, description="`kvflow serve` only (docs/serve.md).")
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict, description="`kvflow run` only: a grid, dotted path -> values, run as with one "
        "`--sweep PATH=V1,V2` per entry (first entry slowest); a --sweep on the same path replaces it. Not part of "
        "a point's configuration (its results directory).")

    @field_validator("sweep")
    @classmethod
    def _sweep_values(cls, v: dict) -> dict:
        for path, values in v.items():
            if not values:
                raise ValueError(f"sweep axis '{path}' has no values")
        return v

    @field_validator("proposers")
    @classmethod
    def _at_least_one(cls, v: dict) -> dict:
        if not v:
            raise ValueError("a pipeline needs at least one proposer")
        return v

    # Cross-references (proposer -> model, scorer -> model/proposer) are checked in
    # kvflow.config.validate, where each problem can be reported with its file and line.
