"""Why does vLLM refuse EAGLE-3 for this target, and what would make it accept?

Everything here is found by introspecting the *installed* vLLM (its model registry, ``inspect``, the
``SupportsEagle3`` Protocol, the source text of the installed package) rather than by hard-coded line
numbers or member lists, so the same code answers for every release from 0.15 through 0.26. No GPU and no
weights are needed: an architecture name or a config.json is enough. vLLM is reached only through
:mod:`eagle3lab.vllm_compat`, and imported lazily.

The package follows the steps of a diagnosis, one module each:

- :mod:`.target_info`: the target from a name, a config.json or a folder (no vLLM);
- :mod:`.protocol`: the installed ``SupportsEagle3`` Protocol and a class's standing against it;
- :mod:`.levels`: the chain from the registered class to the model that runs the layers;
- :mod:`.sources`: where the refusal is raised and the front-end gate, in the installed sources;
- :mod:`.aux_ids`: the aux ids vLLM would use (rules in :mod:`eagle3lab.aux_layers`);
- :mod:`.plan`: what our patch would change for a class, or why it will not (shared with the patch);
- :mod:`.verdict`: :func:`diagnose`, the verdict (native / patchable / unsupported) and the patch plan;
- :mod:`.registry`: every registered architecture at once, each with the plan's verdict;
- :mod:`.figures`: the members-per-level heatmap and the registry chart.

``from eagle3lab import diagnose as dg; dg.diagnose("KimiK25ForConditionalGeneration")`` is the entry.
"""

from eagle3lab.aux_layers import aux_id_problems, default_aux_layer_ids
from eagle3lab.diagnose.aux_ids import AuxIds, drafter_aux_ids, resolve_aux_ids
from eagle3lab.diagnose.figures import interface_figure, registry_figure
from eagle3lab.diagnose.levels import Level, level_chain
from eagle3lab.diagnose.plan import PatchPlan, plan_for
from eagle3lab.diagnose.protocol import (
    InterfaceReport,
    eagle3_protocol_members,
    implemented_interfaces,
    interface_report,
)
from eagle3lab.diagnose.registry import (
    STATUSES,
    RegistryCounts,
    RegistryRow,
    reason_counts,
    registry_counts,
    registry_row,
    registry_status,
    registry_table,
    write_registry_csv,
)
from eagle3lab.diagnose.sources import Gate, SourceSite, evaluate_gates, find_raise_sites
from eagle3lab.diagnose.target_info import TargetInfo, read_json_config, target_info, text_config_of
from eagle3lab.diagnose.verdict import (
    FAMILY_CAUSAL_LM,
    FAMILY_INNER_MODEL,
    Diagnosis,
    PlanStep,
    diagnose,
    format_diagnosis,
)
from eagle3lab.vllm_compat import REFUSAL_MESSAGE, vllm_package_dir

__all__ = [
    "FAMILY_CAUSAL_LM", "FAMILY_INNER_MODEL", "REFUSAL_MESSAGE", "STATUSES", "AuxIds", "Diagnosis", "Gate",
    "InterfaceReport", "Level", "PatchPlan", "PlanStep", "RegistryCounts", "RegistryRow", "SourceSite", "TargetInfo",
    "aux_id_problems", "default_aux_layer_ids", "diagnose", "drafter_aux_ids", "eagle3_protocol_members",
    "evaluate_gates", "find_raise_sites", "format_diagnosis", "implemented_interfaces", "interface_figure", "interface_report",
    "level_chain", "plan_for", "read_json_config", "reason_counts", "registry_counts", "registry_figure", "registry_row", "registry_status",
    "registry_table", "resolve_aux_ids", "write_registry_csv", "target_info", "text_config_of", "vllm_package_dir",
]
