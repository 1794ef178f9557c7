"""eagle3lab.layer_loop on small torch models written in each loop style vLLM's models use (no vLLM needed).

Each fake model below is an ``nn.Module`` whose ``forward`` copies the shape of a real vLLM inner-model
forward: islice over this pipeline rank's layers (Glm4MoeModel, Mixtral, Qwen2-MoE, Gemma3), a slice
(MiniMax-M2 on 0.17), enumerate around islice (HY-V3), the whole list, with a separate residual (fused
add-norm layers returning ``(hidden, residual)``) or without (Granite, Olmo3, Arctic). The forward is rewritten
and compiled exactly as the patch does it (``patch._rewritten_forward``, in this module, which therefore
holds the two helpers the patch installs in a model's module), then checked numerically: aux id k must be
the residual stream at the INPUT of global layer k (``hidden + residual``, or ``hidden`` without a residual),
captured independently by a forward pre-hook on the layer, and id == number of layers the state the final
norm receives. Refusals are checked by their one-line reason, the text ``diagnose`` shows.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from eagle3lab import layer_loop, patch

# What the patch installs in the model's module before compiling the rewritten forward there.
globals()[layer_loop.OUT_HELPER] = layer_loop.aux_out
globals()[layer_loop.STATE_HELPER] = layer_loop.aux_state

N_LAYERS, DIM = 5, 8
DT = torch.float64


def _weight(seed: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(DIM, DIM, generator=g, dtype=DT) / DIM**0.5)


class FusedLayer(nn.Module):
    """vLLM's fused add-norm decoder layer: input stream = hidden + residual; returns (delta, stream)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.w = _weight(i)

    def forward(self, positions, hidden_states, residual, **kwargs):
        stream = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(stream @ self.w) + 0.01 * positions[:, None], stream


class PlainLayer(nn.Module):
    """A layer that returns the stream itself (no separate residual)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.w = _weight(i)

    def forward(self, positions, hidden_states, **kwargs):
        return hidden_states + torch.tanh(hidden_states @ self.w) + 0.01 * positions[:, None]


class PairLayer(PlainLayer):
    """Returns (stream, something else) that the loop discards (`hidden_states, _ = layer(...)`, SigLIP's)."""

    def forward(self, positions, hidden_states, **kwargs):
        out = super().forward(positions, hidden_states)
        return out, torch.sin(out)


class MissingLayer(nn.Module):
    """vLLM's PPMissingLayer: a layer of another pipeline rank, never run here."""

    def forward(self, *args, **kwargs):
        raise AssertionError("a layer outside [start_layer, end_layer) ran")


class Norm(nn.Module):
    """RMSNorm-like final norm: ``norm(h)`` or vLLM's fused ``norm(h, residual) -> (normed, h + residual)``."""

    def forward(self, hidden_states, residual=None):
        stream = hidden_states if residual is None else hidden_states + residual
        normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed if residual is None else (normed, stream)


class _Model(nn.Module):
    layer_cls: type[nn.Module] = FusedLayer
    pipeline = True  # the forward slices self.layers by start_layer/end_layer

    def __init__(self, start: int = 0, end: int = N_LAYERS, last_rank: bool = True) -> None:
        super().__init__()
        self.start_layer, self.end_layer, self.is_last_rank = start, end, last_rank
        self.layers = nn.ModuleList(self.layer_cls(i) if start <= i < end else MissingLayer()
                                    for i in range(N_LAYERS))
        self.embed = nn.Embedding(32, DIM, dtype=DT)
        nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(99))
        self.norm = Norm()
        self.multiplier = 1.5
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.requires_grad_(False)


# ---- the loop styles (each forward is read back with inspect.getsource, as the patch reads vLLM's) -------


class IsliceResidual(_Model):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """Glm4MoeModel.forward's shape: pipeline hand-off in and out, islice over this rank's layers."""
        if intermediate_tensors is None:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_rank:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SliceResidual(_Model):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """MiniMaxM2Model.forward's shape (vLLM 0.17): a slice of self.layers."""
        if intermediate_tensors is None:
            hidden_states = self.embed(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_rank:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class EnumerateIsliceResidual(_Model):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """HYV3Model.forward's shape: enumerate around islice, the local index passed to the layer."""
        if intermediate_tensors is None:
            hidden_states = self.embed(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for idx, layer in enumerate(
            islice(self.layers, self.start_layer, self.end_layer)
        ):
            hidden_states, residual = layer(positions, hidden_states, residual, idx=idx)
        if not self.is_last_rank:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        return hidden_states


class WholeResidual(_Model):
    pipeline = False

    def forward(self, input_ids, positions):
        """A whole loop (the EAGLE drafters' and other single-rank models' shape)."""
        hidden_states = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class IsliceNoResidual(_Model):
    layer_cls = PlainLayer

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """GraniteModel.forward's shape: no residual, an in-place scaling of the embeddings first."""
        if intermediate_tensors is None:
            hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            hidden_states *= self.multiplier
        else:
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states = layer(positions, hidden_states)
        if not self.is_last_rank:
            return {"hidden_states": hidden_states}
        hidden_states = self.norm(hidden_states)
        return hidden_states


class WholeNoResidual(_Model):
    layer_cls = PlainLayer
    pipeline = False

    def forward(self, input_ids, positions):
        """A whole loop without a residual."""
        hidden_states = self.embed(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class EnumerateStartNoResidual(_Model):
    layer_cls = PlainLayer
    pipeline = False

    def forward(self, input_ids, positions):
        """granite_speech's shape: enumerate(..., start=1); its index is not the layer id."""
        hidden_states = self.embed(input_ids)
        for idx, layer in enumerate(self.layers, start=1):
            hidden_states = layer(positions, hidden_states, idx=idx)
        return self.norm(hidden_states)


class DiscardedSecondOutput(_Model):
    layer_cls = PairLayer
    pipeline = False

    def forward(self, input_ids, positions):
        """SiglipEncoder's / Gemma4DSparkModel's shape: a second output is bound to `_` and not fed back."""
        hidden_states = self.embed(input_ids)
        for layer in self.layers:
            hidden_states, _ = layer(positions, hidden_states)
        return self.norm(hidden_states)


class IsliceUnusedSecondOutput(_Model):
    layer_cls = PairLayer

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """StableLMEpochModel.forward's shape: a second output named `residual` that is never fed back."""
        if intermediate_tensors is None:
            hidden_states = self.embed(input_ids)
        else:
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states)
        if not self.is_last_rank:
            return {"hidden_states": hidden_states}
        hidden_states = self.norm(hidden_states)
        return hidden_states


ISLICE = "islice(self.layers, self.start_layer, self.end_layer)"
# class, the loop's iterable as analysed, its start id (source), the residual variable
VARIANTS = {
    IsliceResidual: (ISLICE, "self.start_layer", "residual"),
    SliceResidual: ("self.layers[self.start_layer:self.end_layer]", "self.start_layer", "residual"),
    EnumerateIsliceResidual: (f"enumerate({ISLICE})", "self.start_layer", "residual"),
    WholeResidual: ("self.layers", "0", "residual"),
    IsliceNoResidual: (ISLICE, "self.start_layer", None),
    WholeNoResidual: ("self.layers", "0", None),
    EnumerateStartNoResidual: ("enumerate(self.layers, start=1)", "0", None),
    DiscardedSecondOutput: ("self.layers", "0", None),
    IsliceUnusedSecondOutput: (ISLICE, "self.start_layer", None),
}
by_name = pytest.mark.parametrize("cls", list(VARIANTS), ids=lambda c: c.__name__)


def _source(cls: type) -> str:
    return inspect.getsource(cls.forward)


def _rewritten(cls: type):
    """``cls.forward`` rewritten and compiled by the patch's own path (in this module)."""
    loop = layer_loop.analyse_forward(_source(cls))
    return patch._rewritten_forward(cls, SimpleNamespace(loop=loop))


# ---- running a model and capturing the streams independently --------------------------------------------


def _inputs(model: _Model) -> tuple[tuple, dict]:
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6)
    if not model.pipeline:
        return (ids, pos), {}
    inter = None
    if model.start_layer > 0:  # a later pipeline rank: the stream arrives from the previous one
        g = torch.Generator().manual_seed(7)
        inter = {"hidden_states": torch.randn(6, DIM, generator=g, dtype=DT)}
        if VARIANTS[type(model)][2] is not None:
            inter["residual"] = torch.randn(6, DIM, generator=g, dtype=DT)
    return (ids, pos, inter), {}


def _capture(model: _Model) -> dict[int, torch.Tensor]:
    """Hooks recording, by global id, the stream each layer receives and (id N_LAYERS) what the norm receives."""
    seen: dict[int, torch.Tensor] = {}

    def record(k: int):
        def hook(module, args, kwargs):
            hidden = args[1] if k < N_LAYERS else args[0]
            residual = args[2] if k < N_LAYERS and len(args) > 2 else (args[1] if k == N_LAYERS and len(args) > 1
                                                                      else None)
            seen[k] = (hidden if residual is None else hidden + residual).clone()
        return hook

    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(record(k), with_kwargs=True)
    model.norm.register_forward_pre_hook(record(N_LAYERS), with_kwargs=True)
    return seen


def _ranges(cls: type) -> list[tuple[int, int]]:
    return [(0, N_LAYERS), (2, N_LAYERS)] if cls.pipeline else [(0, N_LAYERS)]


# ---- the tests -----------------------------------------------------------------------------------------


@by_name
def test_variant_is_analysed(cls):
    loop = layer_loop.analyse_forward(_source(cls))
    form, start, residual = VARIANTS[cls]
    assert loop.ok and not loop.collects_aux and loop.reason == ""
    assert (loop.form, loop.start, loop.hidden, loop.residual) == (form, start, "hidden_states", residual)


@by_name
def test_rewrite_keeps_docstring_and_signature(cls):
    src = textwrap.dedent(_source(cls))
    new = layer_loop.rewrite_forward(src)
    before, after = ast.parse(src).body[0], ast.parse(new).body[0]
    assert after.name == before.name == "forward"
    assert ast.unparse(after.args) == ast.unparse(before.args)
    assert ast.get_docstring(after) == ast.get_docstring(before) == inspect.getdoc(cls.forward)
    assert layer_loop.OUT_HELPER in new and layer_loop.AUX in new
    # compiled on its own, it is a function with the original's signature and docstring
    scope: dict = {}
    exec(compile(new, "<rewritten>", "exec"), globals(), scope)  # noqa: S102 - our own test source
    assert inspect.signature(scope["forward"]) == inspect.signature(cls.forward)
    assert scope["forward"].__doc__ == cls.forward.__doc__


def test_the_rewritten_code_lives_in_a_file_of_its_own_text(tmp_path, monkeypatch):
    """vLLM keys its torch.compile cache by the text of each traced file, read from disk: the rewritten forward's
    file must exist and hold exactly the code that runs, so that another rewrite gets another key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cls_a, cls_b = list(VARIANTS)[:2]
    fa, fb = _rewritten(cls_a), _rewritten(cls_b)
    path_a, path_b = Path(fa.__code__.co_filename), Path(fb.__code__.co_filename)
    assert path_a.is_file() and path_a.is_relative_to(tmp_path)
    assert path_a != path_b  # other code, other file
    text = path_a.read_text()
    assert text.startswith("def _eagle3lab_factory(__class__):") and layer_loop.AUX in text
    # the function's own source, as inspect (and a traceback) finds it, is the rewritten loop
    assert layer_loop.AUX in inspect.getsource(fa) and "for " in inspect.getsource(fa)
    # rewriting again reuses the same file, unchanged
    assert Path(_rewritten(cls_a).__code__.co_filename) == path_a and path_a.read_text() == text
    assert len(list(path_a.parent.glob("*.py"))) == 2 and not list(path_a.parent.glob(".*.tmp"))


@by_name
def test_collects_the_stream_at_each_layer_input(cls):
    fwd = _rewritten(cls)
    for start, end in _ranges(cls):
        model = cls(start, end)
        seen = _capture(model)
        args, kw = _inputs(model)
        plain = cls.forward(model, *args, **kw)
        want_ids = list(range(start, end + 1))  # every layer of this rank and the final state (global ids)
        model.aux_hidden_state_layers = tuple(reversed(want_ids))  # the order asked is not the order given
        seen.clear()
        out, aux = fwd(model, *args, **kw)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)  # the normal output is unchanged
        assert sorted(seen) == want_ids
        assert len(aux) == len(want_ids), (start, end)
        for k, got in zip(want_ids, aux, strict=True):
            torch.testing.assert_close(got, seen[k], rtol=0, atol=0, msg=lambda m, k=k: f"id {k}: {m}")


@by_name
def test_some_ids_only(cls):
    # A typical EAGLE-3 choice (low, middle, final) on the last rank: exactly those, ascending.
    fwd = _rewritten(cls)
    start = 2 if cls.pipeline else 0
    model = cls(start, N_LAYERS)
    seen = _capture(model)
    model.aux_hidden_state_layers = (N_LAYERS, 3)
    _, aux = fwd(model, *_inputs(model)[0])
    assert len(aux) == 2
    torch.testing.assert_close(aux[0], seen[3], rtol=0, atol=0)
    torch.testing.assert_close(aux[1], seen[N_LAYERS], rtol=0, atol=0)


@pytest.mark.parametrize("cls", [c for c in VARIANTS if c.pipeline], ids=lambda c: c.__name__)
def test_ids_of_earlier_ranks_are_not_collected_here(cls):
    # Global ids: on the rank running layers 2..4, ids 0 and 1 name layers of an earlier rank.
    fwd = _rewritten(cls)
    model = cls(2, N_LAYERS)
    args, kw = _inputs(model)
    plain = cls.forward(model, *args, **kw)
    model.aux_hidden_state_layers = (0, 1)
    got = fwd(model, *args, **kw)
    assert isinstance(got, torch.Tensor)  # nothing collected: the plain result
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


@by_name
def test_no_ids_no_change(cls):
    fwd = _rewritten(cls)
    for start, end in _ranges(cls):
        model = cls(start, end)
        args, kw = _inputs(model)
        plain, got = cls.forward(model, *args, **kw), fwd(model, *args, **kw)
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [c for c in VARIANTS if c.pipeline], ids=lambda c: c.__name__)
def test_earlier_pipeline_rank_hands_off_unchanged(cls):
    # Not the last rank: the hand-off dict goes on as it is, even with ids asked (including this rank's own).
    fwd = _rewritten(cls)
    model = cls(0, 3, last_rank=False)
    args, kw = _inputs(model)
    plain = cls.forward(model, *args, **kw)
    model.aux_hidden_state_layers = (1, 2, 3, 5)
    got = fwd(model, *args, **kw)
    assert isinstance(got, dict) and got.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(got[key], plain[key], rtol=0, atol=0)


# ---- refusals: one line each, the text diagnose prints ---------------------------------------------------

_REFUSED = {
    "index_loop_step3p5": ("""
        def forward(self, positions, hidden_states, residual):
            for i in range(self.start_layer, self.end_layer):
                layer = self.layers[i]
                hidden_states, residual = layer(positions, hidden_states, residual)
            return hidden_states
        """, "its forward indexes self.layers[...] inside `for ... in range(self.start_layer, self.end_layer)` "
             "instead of iterating the layers; only loops over self.layers (whole, sliced, islice, enumerate) are "
             "rewritten"),
    "nested_loops_ouro": ("""
        def forward(self, positions, hidden_states):
            for step in range(self.total_ut_steps):
                for layer in self.layers[self.start_layer : self.end_layer]:
                    hidden_states = layer(positions, hidden_states)
            return hidden_states
        """, "its layer loop runs inside another loop (over `range(self.total_ut_steps)`): the layers run several "
             "times per forward, so a layer id names no single point of the residual stream"),
    "two_loops": ("""
        def forward(self, positions, hidden_states):
            for layer in self.layers:
                hidden_states = layer(positions, hidden_states)
            for layer in self.layers:
                hidden_states = layer(positions, hidden_states)
            return hidden_states
        """, "its forward loops over self.layers 2 times; the layer ids are ambiguous"),
    "no_layers_loop": ("""
        def forward(self, positions, hidden_states):
            for block in self.blocks:
                hidden_states = block(positions, hidden_states)
            return hidden_states
        """, "its forward has no loop over self.layers"),
    "branches_decilm": ("""
        def forward(self, positions, hidden_states, residual):
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                if not layer._is_no_op_attention:
                    hidden_states, residual = layer(positions, hidden_states, residual)
                    kv_cache_index += 1
                else:
                    hidden_states, residual = layer(positions, hidden_states, residual)
            return hidden_states
        """, "its layer call `if not layer._is_no_op_attention: ...` is not `hidden[, residual] = layer(...)`"),
    "called_twice": ("""
        def forward(self, positions, hidden_states):
            for layer in self.layers:
                hidden_states = layer(positions, hidden_states)
                hidden_states = layer(positions, hidden_states)
            return hidden_states
        """, "its layer loop calls `layer(...)` 2 times; expected exactly once"),
    "stepped_slice": ("""
        def forward(self, positions, hidden_states):
            for layer in self.layers[::2]:
                hidden_states = layer(positions, hidden_states)
            return hidden_states
        """, "its layer loop iterates `self.layers[::2]`, not self.layers, a slice of it or islice"),
    "output_not_fed_back": ("""
        def forward(self, hidden_states):
            for layer in self.layers:
                layer_outputs = layer(hidden_states)
                hidden_states = layer_outputs[0]
            return hidden_states
        """, "its layer call does not pass `layer_outputs` back in; not a residual-stream loop"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_refused_with_one_line_reason(case):
    src, reason = _REFUSED[case]
    loop = layer_loop.analyse_forward(textwrap.dedent(src))
    assert not loop.ok and not loop.collects_aux
    assert loop.reason == reason
    assert "\n" not in loop.reason
    with pytest.raises(ValueError, match="cannot rewrite this forward") as err:
        layer_loop.rewrite_forward(textwrap.dedent(src))
    assert str(err.value).endswith(reason)


def test_native_forward_is_left_alone():
    src = """
        def forward(self, positions, hidden_states, residual):
            aux_hidden_states = []
            for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
                if idx in self.aux_hidden_state_layers:
                    aux_hidden_states.append(hidden_states + residual)
                hidden_states, residual = layer(positions, hidden_states, residual)
            return hidden_states, aux_hidden_states
        """
    loop = layer_loop.analyse_forward(textwrap.dedent(src))
    assert loop.ok and loop.collects_aux and loop.reason == "its forward already collects aux hidden states"
    with pytest.raises(ValueError, match="already collects"):
        layer_loop.rewrite_forward(textwrap.dedent(src))


def test_aux_out_passes_non_tensors_through():
    t = torch.zeros(2)
    assert layer_loop.aux_out(t, []) is t
    assert layer_loop.aux_out(t, [t])[1] == [t]
    handoff = {"hidden_states": t}
    assert layer_loop.aux_out(handoff, [t]) is handoff


# ---- what a decoder layer does with the residual it is fed (residual_convention) -----------------------------
# Sources in the shapes of vLLM 0.26's decoder layers: the convention decides whether aux id k is hidden + residual
# or hidden alone, so each shape must land on the right side, and anything else must say it cannot tell.

_FUSED = '''
def forward(self, positions, hidden_states, residual):
    if residual is None:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    return self.mlp(hidden_states), residual
'''
_FUSED_HIDDEN_FIRST = _FUSED.replace("positions, hidden_states, residual", "hidden_states, positions, residual")
_POST_LN = '''
def forward(self, positions, hidden_states, residual):
    """Exaone-4."""
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
    hidden_states = hidden_states + residual
    residual = hidden_states
    hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
    return residual + hidden_states, residual
'''
_PARALLEL = '''
def forward(self, positions, hidden_states, residual):
    residual = hidden_states
    hidden_states, residual = self.input_layernorm(hidden_states, residual)
    attn = self.self_attn(positions=positions, hidden_states=hidden_states)
    return residual + attn + self.mlp(hidden_states), residual
'''
_NEVER_READ = '''
def forward(self, positions, hidden_states, residual):
    out = hidden_states + self.mlp(self.input_layernorm(hidden_states))
    return out, None
'''
_ADDED_BY_HAND = '''
def forward(self, positions, hidden_states, residual):
    if residual is not None:
        hidden_states = hidden_states + residual
    return self.mlp(hidden_states), hidden_states
'''
_DELEGATES = '''
def forward(self, positions, hidden_states, residual):
    return super().forward(positions, hidden_states, residual)
'''


@pytest.mark.parametrize(("source", "slot", "hidden", "convention", "quote"), [
    (_FUSED, 2, 1, layer_loop.FUSED, "self.input_layernorm(hidden_states, residual)"),
    (_FUSED_HIDDEN_FIRST, 2, 0, layer_loop.FUSED, "self.input_layernorm(hidden_states, residual)"),
    (_FUSED, "residual", "hidden_states", layer_loop.FUSED, "self.input_layernorm"),
    (_POST_LN, 2, 1, layer_loop.DISCARDS, "`residual = hidden_states` overwrites `residual` before reading it"),
    (_PARALLEL, 2, 1, layer_loop.DISCARDS, "`residual = hidden_states` overwrites"),
    (_NEVER_READ, 2, 1, layer_loop.DISCARDS, "never reads `residual`"),
])
def test_residual_convention_is_read_from_the_layer(source, slot, hidden, convention, quote):
    use = layer_loop.residual_convention(source, slot, hidden)
    assert use.known and use.convention == convention, use
    assert quote in use.why and "\n" not in use.why


@pytest.mark.parametrize(("source", "slot", "hidden", "quote"), [
    (_ADDED_BY_HAND, 2, 1, "if residual is not None:"),  # plausibly hidden + residual, but not a known pattern
    (_DELEGATES, 2, 1, "return super().forward"),
    (_FUSED, 5, 1, "do not match the loop's call"),
])
def test_residual_convention_unknown_is_said_not_guessed(source, slot, hidden, quote):
    use = layer_loop.residual_convention(source, slot, hidden)
    assert not use.known and use.convention == ""
    assert quote in use.why and "\n" not in use.why


class _PostLNLayer(nn.Module):
    """A post-LN layer: discards the residual it is fed, returns (stream, mid-layer stream)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.w = _weight(seed)

    def forward(self, positions, hidden_states, residual):
        mid = hidden_states + torch.tanh(hidden_states @ self.w)
        return mid + torch.sin(mid @ self.w), mid


class _PostLNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_PostLNLayer(k) for k in range(N_LAYERS))
        self.start_layer, self.end_layer = 0, N_LAYERS
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(self, hidden_states, positions):
        residual = None
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states * 2.0


@pytest.mark.parametrize("adds", [False, True])
def test_rewrite_follows_the_convention(adds):
    """With the layers' convention (hidden alone) the aux states are the streams each layer receives; with the
    fused-add rule applied to these layers they are not: the check can tell the two apart."""
    model = _PostLNModel()
    src = inspect.getsource(_PostLNModel.forward)
    loop = layer_loop.analyse_forward(src)
    assert loop.ok and loop.residual == "residual" and loop.residual_arg == 2 and loop.hidden_arg == 1
    loop.stream_adds_residual = adds
    env: dict = dict(globals())
    exec(compile(layer_loop.rewrite_forward(textwrap.dedent(src), loop), "<rewritten>", "exec"), env)
    seen: dict[int, torch.Tensor] = {}
    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda _m, args, k=k: seen.__setitem__(k, args[1].clone()))
    model.aux_hidden_state_layers = (1, 3)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(3), dtype=DT)
    _, aux = env["forward"](model, x, torch.arange(4))
    same = [torch.equal(a, seen[k]) for k, a in zip((1, 3), aux, strict=True)]
    assert same == [not adds, not adds]
