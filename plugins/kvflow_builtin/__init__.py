"""kvflow's built-in components, registered through the same hooks a third-party plugin uses
(entry point ``builtin`` in the ``kvflow`` group of kvflow's own pyproject)."""

from kvflow.hookspecs import hookimpl

_EVICTORS = {
    "none": "kvflow_builtin.evictors.none:NoEviction",
    "random": "kvflow_builtin.evictors.random:RandomEvictor",
    "streaming": "kvflow_builtin.evictors.streaming:StreamingEvictor",
    "snapkv": "kvflow_builtin.evictors.snapkv:SnapKVEvictor",
    "rkv": "kvflow_builtin.evictors.rkv:RKVEvictor",
    "h2o": "kvflow_builtin.evictors.h2o:H2OEvictor",
    "vase": "kvflow_builtin.evictors.vase:VaSEEvictor",
    "breadthkv": "kvflow_builtin.evictors.breadthkv:BreadthKVEvictor",
    "pyramidkv": "kvflow_builtin.evictors.pyramidkv:PyramidKVEvictor",
    "ada-snapkv": "kvflow_builtin.evictors.ada_snapkv:AdaSnapKVEvictor",
    # kvpress's score-only presses (docs/components.md, "kvpress presses in kvflow")
    "knorm": "kvflow_builtin.evictors.knorm:KnormEvictor",
    "keydiff": "kvflow_builtin.evictors.keydiff:KeyDiffEvictor",
    "lagkv": "kvflow_builtin.evictors.lagkv:LagKVEvictor",
    "tova": "kvflow_builtin.evictors.tova:TOVAEvictor",
    "cur": "kvflow_builtin.evictors.cur:CUREvictor",
    "expected-attention": "kvflow_builtin.evictors.expected_attention:ExpectedAttentionEvictor",
}
_PRUNERS = {
    "entropy": "kvflow_builtin.pruners.entropy:EntropyPruner",
    "gzip": "kvflow_builtin.pruners.gzip:GzipPruner",
    "confidence": "kvflow_builtin.pruners.confidence:ConfidencePruner",
}
_SCORERS = {
    "likelihood": "kvflow_builtin.scorers.likelihood:LikelihoodScorer",
    "llm_judge": "kvflow_builtin.scorers.llm_judge:LLMJudgeScorer",
    "prm": "kvflow_builtin.scorers.prm:PRMScorer",
    "random": "kvflow_builtin.scorers.random:RandomScorer",
}
_COMMITTERS = {
    "best": "kvflow_builtin.committers.best:BestCommitter",
    "margin": "kvflow_builtin.committers.margin:MarginCommitter",
}


@hookimpl
def register_evictors(register):
    for name, target in _EVICTORS.items():
        register(name, target)


@hookimpl
def register_pruners(register):
    for name, target in _PRUNERS.items():
        register(name, target)


@hookimpl
def register_scorers(register):
    for name, target in _SCORERS.items():
        register(name, target)


@hookimpl
def register_committers(register):
    for name, target in _COMMITTERS.items():
        register(name, target)


@hookimpl
def register_backends(register):
    register("hf", "kvflow.backends.hf:HFBackend")
    register("sglang", "kvflow.backends.sglang:SGLangBackend")
    register("vllm", "kvflow.backends.vllm:VLLMBackend")
