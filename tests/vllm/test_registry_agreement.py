"""Diagnose and patch agree on every architecture of the installed vLLM's registry (run on 0.26 and on 0.17).

For each registered architecture: what ``diagnose`` says (its verdict and the plan's verdict) must be what
``patch --check`` achieves by actually applying the patch in this process and reverting it:
- native: nothing to do, the class passes vLLM's own ``supports_eagle3``;
- patchable: the patch makes changes, after which ``supports_eagle3`` is True and the inner model collects aux
  states (the check's ``ok``);
- unsupported: the patch refuses with the plan's own reason and changes nothing;
- not loadable here: both say so, naming the import error.
The issue that asked for this saw ``diagnose KimiVLForConditionalGeneration`` say "patchable" while
``patch --check`` failed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm need an installed vLLM (0.26.0 in .venv, 0.17.0 in .venvs)")
pytest.importorskip("torch")

from eagle3lab import diagnose as dg  # noqa: E402
from eagle3lab import patch, patch_check, vllm_compat  # noqa: E402

NATIVE = vllm_compat.version_tuple() >= (0, 18)
# Named by the issue: patchable on 0.26 without the legacy simulation, or refused with the reason.
PATCHABLE_026 = ("Glm4MoeForCausalLM", "BailingMoeV2ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                 "Gemma3ForCausalLM", "KimiVLForConditionalGeneration")


@pytest.fixture(scope="module")
def rows(registry_rows):
    patch.revert()
    yield list(registry_rows)
    patch.revert()


def test_every_architecture_diagnose_equals_patch_check(rows):
    disagreements = []
    for row in rows:
        patch.revert()
        if row.status == dg.registry.NOT_LOADABLE:
            with pytest.raises(ValueError, match="cannot load|failed to import|not in vLLM"):
                patch_check.check(row.architecture)
            continue
        d = dg.diagnose(row.architecture)
        expected = {"native": "native", "patchable": "patchable", "not patchable": "unsupported"}[row.status]
        if d.patch_plan is None or d.patch_plan.verdict != expected:
            disagreements.append((row.architecture, "diagnose plan", d.patch_plan and d.patch_plan.verdict, expected))
            continue
        if expected == "unsupported" and d.verdict != "unsupported":
            disagreements.append((row.architecture, "diagnose verdict", d.verdict, expected))
        c = patch_check.check(row.architecture, apply=True, legacy_simulation=False)
        if expected == "native":
            # a native multimodal wrapper gets one change only: the image-token alias vLLM's EAGLE proposer needs
            # (patch.alias_image_token_index); its EAGLE-3 members and forward stay vLLM's
            good = (c["ok"] and all("image_token_index for vLLM's EAGLE proposer" in a for a in c["actions"])
                    and c["after"]["supports_eagle3"])
        elif expected == "patchable":
            good = c["ok"] and bool(c["actions"]) and c["refusal_after"] is None and c["error"] is None
        else:
            good = (not c["ok"] and c["error"] is not None and row.reason in c["error"] and not c["actions"]
                    and c["after"]["supports_eagle3"] is False)
        if not good:
            disagreements.append((row.architecture, expected, c.get("error") or c.get("reason"), c["after_plan"]))
    patch.revert()
    assert not disagreements, disagreements
    statuses = {r.status for r in rows}
    assert {"native", "patchable", "not patchable"} <= statuses


def test_patch_leaves_nothing_behind(rows):
    """After checking every patchable architecture and reverting, every class is as installed."""
    patchable = [r.architecture for r in rows if r.status == "patchable"]
    before = {a: vllm_compat.supports_eagle3(vllm_compat.load_model_class(a)) for a in patchable}
    patch.apply(architectures=patchable)
    assert all(vllm_compat.supports_eagle3(vllm_compat.load_model_class(a)) for a in patchable)
    patch.revert()
    assert patch.applied() == {}
    assert {a: vllm_compat.supports_eagle3(vllm_compat.load_model_class(a)) for a in patchable} == before


@pytest.mark.skipif(not NATIVE, reason="the issue's list is for vLLM 0.26 (0.17 lacks some of these classes)")
@pytest.mark.parametrize("arch", PATCHABLE_026)
def test_named_families_patchable_without_simulation(rows, arch):
    row = next(r for r in rows if r.architecture == arch)
    assert row.status == "patchable", row.reason
    patch.revert()
    c = patch_check.check(arch, legacy_simulation=True)  # as the CLI's default profile asks: ignored for these
    assert c["legacy_simulation"] is False and c["ok"] and c["refusal_before"] and c["refusal_after"] is None
    patch.revert()


@pytest.mark.skipif(not NATIVE, reason="Step-3.5 is in vLLM 0.26's registry, not in 0.17's")
def test_step3p5_refused_with_its_reason(rows):
    row = next(r for r in rows if r.architecture == "Step3p5ForCausalLM")
    assert row.status == "not patchable"
    assert "indexes self.layers" in row.reason
    d = dg.diagnose("Step3p5ForCausalLM")
    assert d.verdict == "unsupported" and any("indexes self.layers" in r for r in d.reasons)
