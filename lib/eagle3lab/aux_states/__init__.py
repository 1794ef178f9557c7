"""Aux hidden states, the drafter's input: one home for getting them from the target and storing them.

- :mod:`~eagle3lab.aux_states.hooks`: from a transformers target, by forward pre-hooks in vLLM's id convention, and
  the hand computation that checks them (:data:`~eagle3lab.aux_states.hooks.AUX_AGREEMENT_TOL`);
- :mod:`~eagle3lab.aux_states.shards`: extraction to disk (safetensors shards, a resumable manifest), the
  :class:`~eagle3lab.aux_states.shards.AuxSource` protocol, and the dataset that reads the shards back;
- :mod:`~eagle3lab.aux_states.route`: 03's choice of source (``data.extractor``) and the check that goes with it.

Inside a vLLM engine (a target transformers cannot hold) the source is
:class:`eagle3lab.engines.capture.EngineAuxSource`: it drives an engine, so it lives with the engines.
"""
