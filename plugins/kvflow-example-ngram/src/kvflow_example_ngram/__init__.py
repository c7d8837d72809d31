"""kvflow plugin `ngram`: registers the n-gram repetition pruner (see `kvflow_example_ngram.pruner`).

The target is a lazy "module:Class" string, so `kvflow validate` and `kvflow ls` only import
the module (for its parameters) when they need it.
"""

import kvflow


@kvflow.hookimpl
def register_pruners(register):
    register("ngram", "kvflow_example_ngram.pruner:NgramRepetitionPruner")
