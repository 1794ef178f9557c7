"""The generic layer-loop rewrite (eagle3lab.layer_loop, through the patch's plan) on the installed vLLM's own
model classes (run in both venvs: 0.26.0 and 0.17.0).

For each architecture that ``plan_for`` calls patchable with a rewritten forward, the real forward source is
analysed (form and residual as expected), rewritten and compiled by the patch's own path, then run on a fake
``self`` with stub layers: aux id k must be the stream at the input of global layer k (each stub records what
it receives), id == number of layers the state the final norm receives, the output equal to the release's
own forward's, and pipeline ranks handled (a later rank's global ids; an earlier rank's hand-off unchanged).
Refused architectures are checked by their one-line reason. A case that one release lacks (or supports
natively) is skipped there with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="tests/vllm need an installed vLLM (0.26.0 in .venv, 0.17.0 in .venvs)")
torch = pytest.importorskip("torch")

from eagle3lab import layer_loop, patch, vllm_compat  # noqa: E402
from eagle3lab.diagnose.levels import level_chain  # noqa: E402
from eagle3lab.diagnose.plan import plan_for  # noqa: E402

ISLICE = "islice(self.layers, self.start_layer, self.end_layer)"
N, DIM = 5, 8
DT = torch.float64

# architecture: (the loop's iterable as analysed, the residual variable, the stub layer the forward drives)
PATCHABLE = {
    "Glm4MoeForCausalLM": (ISLICE, "residual", "fused"),
    "MixtralForCausalLM": (ISLICE, "residual", "fused"),
    "Qwen2MoeForCausalLM": (ISLICE, "residual", "fused"),
    "Gemma3ForCausalLM": (ISLICE, "residual", "fused"),
    "HYV3ForCausalLM": (f"enumerate({ISLICE})", "residual", "fused"),  # 0.26
    "MiniMaxM2ForCausalLM": ("self.layers[self.start_layer:self.end_layer]", "residual", "fused"),  # 0.17
    "GraniteForCausalLM": (ISLICE, None, "plain"),
    "Olmo3ForCausalLM": (ISLICE, None, "plain"),
    "ArcticForCausalLM": (ISLICE, None, "plain"),
    # its layers return (stream, a mid-layer residual) that the loop binds to `residual` but never feeds back
    "StableLmForCausalLM": (ISLICE, None, "pair"),
    # post-LN: the layer overwrites the residual it is fed (`residual = hidden_states`) and returns (stream,
    # mid-layer stream); the loop feeds that second output back, but the stream at a layer's input is hidden alone
    "Exaone4ForCausalLM": (ISLICE, "residual", "post_ln"),
    "PhiMoEForCausalLM": (ISLICE, "residual", "post_ln"),
    # parallel attention + MLP block (Cohere): returns (residual + attn + mlp, the layer's input)
    "CohereForCausalLM": (ISLICE, "residual", "parallel"),
}

_INDEX = ("its forward indexes self.layers[...] inside `for ... in range(self.start_layer, self.end_layer)` "
          "instead of iterating the layers; only loops over self.layers (whole, sliced, islice, enumerate) are "
          "rewritten")
REFUSED = {
    "Step3p5ForCausalLM": ("Step3p5Model", _INDEX),
    "SolarForCausalLM": ("SolarModel", _INDEX),
    "OuroForCausalLM": ("OuroModel", "its layer loop runs inside another loop (over `range(self.total_ut_steps)`): "
                        "the layers run several times per forward, so a layer id names no single point of the "
                        "residual stream"),
    "DeciLMForCausalLM": ("DeciModel", "its layer call `if not layer._is_no_op_attention: ...` is not "
                          "`hidden[, residual] = layer(...)`"),
}


def _load(arch: str) -> type:
    if arch not in vllm_compat.model_registry().get_supported_archs():
        pytest.skip(f"{arch} is not in vLLM {vllm_compat.vllm_version()}'s registry")
    try:
        return vllm_compat.load_model_class(arch)
    except ValueError as exc:
        pytest.skip(str(exc))


def _plan(arch: str):
    """The plan for ``arch`` and the class whose forward it rewrites (found as the patch finds it)."""
    cls = _load(arch)
    p = plan_for(cls)
    if p.verdict == "native":
        pytest.skip(f"{arch} supports EAGLE-3 natively on vLLM {vllm_compat.vllm_version()}")
    by_name = {k.__name__: k for lv in level_chain(cls, []) for k in patch._level_class(lv).__mro__}
    return p, by_name.get(p.forward_owner)


# ---- stubs: the layers record the stream they receive, by global id --------------------------------------


class _Fused:
    """vLLM's fused add-norm layer: stream = hidden + residual in, (delta, stream) out."""

    def __init__(self, k: int, seen: dict) -> None:
        self.k, self.seen, self.w = k, seen, 0.4 + 0.1 * k

    def __call__(self, positions, hidden_states, residual, **kwargs):
        stream = hidden_states if residual is None else hidden_states + residual
        self.seen[self.k] = stream.clone()
        return torch.tanh(stream * self.w), stream


class _Plain(_Fused):
    def __call__(self, positions, hidden_states, **kwargs):
        self.seen[self.k] = hidden_states.clone()
        return hidden_states + torch.tanh(hidden_states * self.w)


class _Pair(_Plain):
    """StableLM's layer: returns (stream, the residual it held half-way)."""

    def __call__(self, positions, hidden_states, **kwargs):
        out = super().__call__(positions, hidden_states)
        return out, 0.5 * (hidden_states + out)


class _Missing:
    def __call__(self, *args, **kwargs):
        raise AssertionError("a layer of another pipeline rank ran")


class _PostLN(_Fused):
    """A post-LN layer (Exaone-4, PhiMoE): ignores the residual it is fed; returns (stream, mid-layer stream)."""

    def __call__(self, positions, hidden_states, residual, **kwargs):
        self.seen[self.k] = hidden_states.clone()
        mid = hidden_states + torch.tanh(hidden_states * self.w)
        return mid + torch.sin(mid), mid


class _Parallel(_Fused):
    """A parallel block (Cohere): ignores the residual it is fed; returns (input + attn + mlp, input)."""

    def __call__(self, positions, hidden_states, residual, **kwargs):
        self.seen[self.k] = hidden_states.clone()
        return hidden_states + torch.tanh(hidden_states * self.w) + torch.sin(hidden_states), hidden_states


_STUBS = {"fused": _Fused, "plain": _Plain, "pair": _Pair, "post_ln": _PostLN, "parallel": _Parallel}
# Families whose layers discard the residual also carry none into the final norm: Exaone-4 and PhiMoE call
# norm(hidden) alone; Cohere's LayerNorm takes the residual argument and ignores it.
_DISCARDS = ("post_ln", "parallel")


def _fake(kind: str, start: int, end: int, aux=()) -> SimpleNamespace:
    seen: dict[int, torch.Tensor] = {}
    emb = torch.randn(32, DIM, generator=torch.Generator().manual_seed(0), dtype=DT)

    def norm(hidden_states, residual=None):
        stream = hidden_states if residual is None or kind in _DISCARDS else hidden_states + residual
        seen[N] = stream.clone()
        return stream * 2.0 if residual is None else (stream * 2.0, stream)

    return SimpleNamespace(
        seen=seen,
        layers=[_STUBS[kind](k, seen) if start <= k < end else _Missing() for k in range(N)],
        start_layer=start, end_layer=end, aux_hidden_state_layers=tuple(aux),
        embed_input_ids=lambda ids: emb[ids], embed_tokens=lambda ids: emb[ids],
        config=SimpleNamespace(embedding_multiplier=1.5), norm=norm,
    )


def _flat(x) -> list:
    if hasattr(x, "tensors"):  # IntermediateTensors
        return [x.tensors[k] for k in sorted(x.tensors)]
    return [x]


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(PATCHABLE))
def test_real_forward_is_analysed_and_compiles(arch):
    p, owner = _plan(arch)
    form, residual, _ = PATCHABLE[arch]
    assert p.verdict == "patchable" and p.forward == "rewrite", p.reason
    assert f"`for ... in {form}`" in p.reason and "\n" not in p.reason
    src = inspect.getsource(inspect.unwrap(owner.__dict__["forward"]))
    loop = layer_loop.analyse_forward(src)
    # the plan adds what the decoder layers' own forwards say about the residual; the loop itself is the same
    assert loop == dataclasses.replace(p.loop, stream_adds_residual=True, convention="")
    kind = PATCHABLE[arch][2]
    assert p.loop.stream_adds_residual == (kind == "fused"), p.loop.convention
    if kind in _DISCARDS:
        assert p.loop.convention.startswith(layer_loop.DISCARDS), p.loop.convention
    assert loop.ok and not loop.collects_aux and loop.form == form and loop.hidden == "hidden_states"
    assert loop.residual == residual and loop.start == ("0" if form == "self.layers" else "self.start_layer")
    compile(layer_loop.rewrite_forward(src), f"<{arch}>", "exec")
    fwd = patch._rewritten_forward(owner, p)
    assert fwd.__eagle3lab__ and inspect.signature(fwd) == inspect.signature(owner.__dict__["forward"])


@pytest.mark.parametrize("rank", ["only", "last", "first"])
@pytest.mark.parametrize("arch", list(PATCHABLE))
def test_real_forward_collects_layer_inputs(arch, rank, monkeypatch):
    p, owner = _plan(arch)
    mod = sys.modules[owner.__module__]
    for name, helper in ((layer_loop.OUT_HELPER, layer_loop.aux_out), (layer_loop.STATE_HELPER, layer_loop.aux_state)):
        monkeypatch.setattr(mod, name, helper, raising=False)  # what the patch installs in the module
    first, last = rank in ("only", "first"), rank in ("only", "last")
    monkeypatch.setattr(mod, "get_pp_group", lambda: SimpleNamespace(is_first_rank=first, is_last_rank=last))
    native, ours = inspect.unwrap(owner.__dict__["forward"]), patch._rewritten_forward(owner, p)
    _, residual, kind = PATCHABLE[arch]
    start, end = {"only": (0, N), "last": (2, N), "first": (0, 3)}[rank]
    ids, pos = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    inter = None
    if not first:
        g = torch.Generator().manual_seed(1)
        t = {"hidden_states": torch.randn(5, DIM, generator=g, dtype=DT)}
        if residual is not None:
            t["residual"] = torch.randn(5, DIM, generator=g, dtype=DT)
        inter = mod.IntermediateTensors(t)

    def run(fn, aux=()):
        m = _fake(kind, start, end, aux)
        return fn(m, ids, pos, inter), m.seen

    want, _ = run(native)
    plain, _ = run(ours)  # no ids asked: exactly the release's result
    assert type(plain) is type(want)
    for a, b in zip(_flat(plain), _flat(want), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    asked = (N, 3, 2, 1, 0)  # unordered, and partly before this rank's layers
    got, seen = run(ours, asked)
    if not last:  # an earlier rank hands its tensors on as they are
        assert type(got) is type(want)
        for a, b in zip(_flat(got), _flat(want), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    out, aux = got
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    expected = [k for k in range(start, end + 1) if k in asked]
    assert sorted(seen) == list(range(start, end + 1))
    assert len(aux) == len(expected), (arch, rank)
    for k, a in zip(expected, aux, strict=True):
        torch.testing.assert_close(a, seen[k], rtol=0, atol=0, msg=lambda m, k=k: f"{arch} id {k}: {m}")


@pytest.mark.parametrize("arch", list(REFUSED))
def test_refused_with_its_reason(arch):
    p = plan_for(_load(arch))
    inner, reason = REFUSED[arch]
    assert p.verdict == "unsupported" and p.inner == inner
    assert p.reason == f"{inner}.forward: {reason}"
    assert "\n" not in p.reason and p.loop is not None and not p.loop.ok


# Inner models whose `self.layers = ...` names a parameter of their __init__ (Llama's `layer_type`), bound by a
# subclass's super().__init__(..., layer_type=X) or a caller: the convention is read from the class really built.
LAYER_CLASS_BY_PARAMETER = {
    "OlmoeForCausalLM": ("OlmoeDecoderLayer", layer_loop.FUSED),
    "SeedOssForCausalLM": ("SeedOssDecoderLayer", layer_loop.FUSED),
    "HyperCLOVAXForCausalLM": ("HyperCLOVAXDecoderLayer", layer_loop.DISCARDS),
}


@pytest.mark.parametrize("arch", list(LAYER_CLASS_BY_PARAMETER))
def test_layer_class_chosen_through_a_parameter(arch):
    from eagle3lab.diagnose.plan import decoder_layer_classes

    cls = _load(arch)
    p = plan_for(cls)
    if p.verdict == "native":
        pytest.skip(f"{arch} supports EAGLE-3 natively on vLLM {vllm_compat.vllm_version()}")
    layer, convention = LAYER_CLASS_BY_PARAMETER[arch]
    inner = next(k for lv in level_chain(cls, []) for k in patch._level_class(lv).__mro__ if k.__name__ == p.inner)
    callers = [patch._level_class(lv) for lv in level_chain(cls, [])]
    assert [c.__name__ for c in decoder_layer_classes(inner, callers)] == [layer]
    assert p.verdict == "patchable" and p.loop.convention.startswith(convention), p.loop.convention


# ---- the image-token alias for vLLM's EAGLE proposer (multimodal wrappers) -----------------------------------


def test_alias_image_token_index_from_kimi_vls_spelling():
    cfg = SimpleNamespace(media_placeholder_token_id=163605, image_token_id=7)
    assert patch.alias_image_token_index(cfg) == "media_placeholder_token_id" and cfg.image_token_index == 163605
    assert patch.alias_image_token_index(cfg) is None and cfg.image_token_index == 163605  # present: untouched
    other = SimpleNamespace(image_token_id=7)
    assert patch.alias_image_token_index(other) == "image_token_id" and other.image_token_index == 7
    bare = SimpleNamespace()
    assert patch.alias_image_token_index(bare) is None and not hasattr(bare, "image_token_index")
    assert patch.alias_image_token_index(None) is None


def test_kimi_vl_gets_the_alias_once_and_revert_removes_it():
    try:
        cls = vllm_compat.load_model_class("KimiVLForConditionalGeneration")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"KimiVLForConditionalGeneration does not load on vLLM {vllm_compat.vllm_version()}: {e}")
    text = vllm_compat.load_model_class("LlamaForCausalLM")
    original = cls.__dict__.get("__init__")
    patch.revert()
    try:
        rep = patch.apply(architectures=["KimiVLForConditionalGeneration"])
        assert any("KimiVLForConditionalGeneration.__init__" in a for a in rep.actions), rep.actions
        assert getattr(cls.__init__, "eagle3lab_alias", False) and vllm_compat.supports_eagle3(cls)
        again = patch.apply(architectures=["KimiVLForConditionalGeneration"])
        assert not any("__init__" in a for a in again.actions)  # once
        # the wrapper runs the original __init__ first, then aliases the instance's config
        fake, called = SimpleNamespace(), []

        def init(self):
            called.append(1)
            self.config = SimpleNamespace(media_placeholder_token_id=9)

        patch._aliasing_init(init)(fake)
        assert called == [1] and fake.config.image_token_index == 9
        assert patch._alias_placeholder(text) == []  # a text model is left alone
    finally:
        patch.revert()
    assert cls.__dict__.get("__init__") is original
