"""Engines that generate text from token ids, behind one protocol (:mod:`~eagle3lab.engines.base`).

- :mod:`~eagle3lab.engines.base`: the :class:`~eagle3lab.engines.base.Engine` protocol, results, timings, argument
  checks, vLLM's speculative config;
- :mod:`~eagle3lab.engines.reference`: transformers, any device (exact, slow);
- :mod:`~eagle3lab.engines.vllm_offline`: vLLM's offline ``LLM`` in processes of the run;
- :mod:`~eagle3lab.engines.vllm_served`: ``vllm serve`` on 127.0.0.1, its OpenAI API and its ``/metrics``;
- :mod:`~eagle3lab.engines.processes`: process groups that do not outlive us, and the exit hooks that stop them;
- :mod:`~eagle3lab.engines.workers`: what vLLM's workers run for us (a report of the loaded model, aux capture);
- :mod:`~eagle3lab.engines.launch_probe`: one EAGLE-3 launch in a fresh process (02), and the probe drafter;
- :mod:`~eagle3lab.engines.capture`: aux hidden states captured inside the serving vLLM engine;
- :mod:`~eagle3lab.engines.factory`: the engine a profile asks for.

Import the submodules themselves: this file imports nothing, so that ``python -m eagle3lab.engines.launch_probe``
and vLLM's workers load only what they use.
"""
