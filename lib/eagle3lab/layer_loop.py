"""Reading and rewriting a model's decoder-layer loop: EAGLE-3 aux collection for any standard loop.

vLLM's text models run their decoder layers in one loop inside the inner model's ``forward``::

    for layer in islice(self.layers, self.start_layer, self.end_layer):
        hidden_states, residual = layer(positions, hidden_states, residual)

EAGLE-3 needs, for each requested id k, the residual stream at the *input* of layer k (vLLM's convention:
``hidden_states + residual`` where the layers read the residual they are fed, vLLM's fused add-norm; the hidden
state alone where they carry no separate residual or discard it, post-LN and parallel blocks:
:func:`residual_convention` reads which from the decoder layer's own forward), and the
forward to return ``(hidden_states, [aux...])``. :func:`analyse_forward` reads a forward's source and says whether
its loop is one we can extend, and if not, why (one line). :func:`rewrite_forward` returns the same source with
the collection added: one counter, one membership test per layer, the final state after the loop, and every
``return x`` turned into ``return _eagle3lab_aux_out(x, aux)``. Everything else of the installed forward
(embeddings, pipeline-parallel hand-off, norms, scaling) stays exactly as the release wrote it.

Pure ``ast``: no vLLM, no torch; the patch (:mod:`eagle3lab.patch`) compiles the result in the model module.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

# Names the rewrite introduces; chosen so that no vLLM forward uses them.
AUX = "_eagle3lab_aux"
COUNTER = "_eagle3lab_k"
OUT_HELPER = "_eagle3lab_aux_out"
STATE_HELPER = "_eagle3lab_aux_state"
LAYERS = "layers"


@dataclass
class LayerLoop:
    """What :func:`analyse_forward` found: a loop we can extend, or the reason we cannot (``reason``)."""

    ok: bool
    reason: str = ""
    form: str = ""  # the loop's iterable as written, e.g. "islice(self.layers, self.start_layer, self.end_layer)"
    start: str = "0"  # the global id of the loop's first layer, as source ("self.start_layer" or "0")
    hidden: str = ""  # the variable holding the hidden states
    residual: str | None = None  # the residual variable, or None where layers return the stream itself
    line: int = 0  # the loop's line within the forward's source
    collects_aux: bool = False  # the forward already collects aux hidden states (vLLM's own support)
    # Where the loop passes `residual` to the layer: its position among the call's arguments, or its keyword.
    residual_arg: int | str | None = None
    hidden_arg: int | str | None = None  # likewise for the hidden state
    # Whether the stream at a layer's input is hidden + residual (fused add-norm layers, which read the residual
    # they are fed) or hidden alone (post-LN and parallel blocks, which discard it). Set by the plan from the
    # decoder layers' own forwards (residual_convention); the rewrite follows it.
    stream_adds_residual: bool = True
    convention: str = ""  # what the decoder layers do with the residual, and the statement that says so (one line)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def _is_self_layers(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == LAYERS and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _mentions_self_layers(node: ast.AST) -> bool:
    return any(_is_self_layers(n) for n in ast.walk(node))


def _unwrap_iterable(it: ast.expr) -> tuple[ast.expr, str] | None:
    """The layer container of a supported loop iterable, and its start id (source); None if unsupported.

    Supported: ``self.layers``, ``self.layers[a:b]``, ``islice(self.layers, a, b)`` (a may be omitted), each
    optionally inside ``enumerate(...)``.
    """
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        it = it.args[0]
    if _is_self_layers(it):
        return it, "0"
    if isinstance(it, ast.Subscript) and _is_self_layers(it.value) and isinstance(it.slice, ast.Slice):
        if it.slice.step is not None:
            return None
        return it.value, ast.unparse(it.slice.lower) if it.slice.lower is not None else "0"
    is_islice = isinstance(it, ast.Call) and getattr(it.func, "id", getattr(it.func, "attr", "")) == "islice"
    if is_islice and it.args and _is_self_layers(it.args[0]) and not it.keywords:
        rest = it.args[1:]
        if len(rest) == 1:  # islice(seq, stop)
            return it.args[0], "0"
        if len(rest) in (2, 3) and (len(rest) == 2 or ast.unparse(rest[2]) in ("1", "None")):
            return it.args[0], ast.unparse(rest[0]) if ast.unparse(rest[0]) != "None" else "0"
    return None


def _loop_names(target: ast.expr) -> str | None:
    """The name the loop binds each layer to (``layer`` or ``(idx, layer)``); None for other targets."""
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Tuple) and len(target.elts) == 2 and all(isinstance(e, ast.Name) for e in target.elts):
        return target.elts[1].id  # type: ignore[union-attr]
    return None


def _layer_calls(body: list[ast.stmt], layer: str) -> list[ast.stmt]:
    """Statements of the loop body that call the layer (``layer(...)``), at any depth."""
    found = []
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == layer:
                found.append(stmt)
                break
    return found


def _first_line(stmt: ast.stmt) -> str:
    """A statement as source on one line (a refusal's reason is one line): its first line, `...` for the rest."""
    lines = ast.unparse(stmt).strip().splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _function(source: str) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(source))
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("expected the source of one function")
    return tree.body[0]  # type: ignore[return-value]


def _own_nodes(func: ast.FunctionDef) -> list[ast.AST]:
    """Nodes of ``func`` that are not inside a nested function or class (their returns are not ours)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(func.body)
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)
    return out


def _collects_aux(func: ast.FunctionDef) -> bool:
    """vLLM's own collection: the forward reads ``self.aux_hidden_state_layers`` and appends to a list inside its
    layer loop (a comment or a name that merely mentions aux states is not enough)."""
    reads_ids = any(isinstance(n, ast.Attribute) and n.attr == "aux_hidden_state_layers"
                    and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(func))
    appends = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
                  and "aux" in ast.unparse(n.func.value) for n in ast.walk(func))
    return reads_ids and appends


def analyse_forward(source: str) -> LayerLoop:
    """Whether the forward in ``source`` runs a decoder-layer loop that :func:`rewrite_forward` can extend."""
    func = _function(source)
    if _collects_aux(func):
        return LayerLoop(ok=True, collects_aux=True, reason="its forward already collects aux hidden states")
    nodes = _own_nodes(func)
    loops = [n for n in nodes if isinstance(n, ast.For) and _mentions_self_layers(n.iter)]
    index_loops = [n for n in nodes if isinstance(n, ast.For) and not _mentions_self_layers(n.iter)
                   and any(isinstance(s, ast.Subscript) and _is_self_layers(s.value) for s in ast.walk(n))]
    if not loops and index_loops:
        loop = index_loops[0]
        return LayerLoop(ok=False, line=loop.lineno, form=ast.unparse(loop.iter),
                         reason=f"its forward indexes self.layers[...] inside `for ... in {ast.unparse(loop.iter)}` "
                                "instead of iterating the layers; only loops over self.layers (whole, sliced, "
                                "islice, enumerate) are rewritten")
    if not loops:
        return LayerLoop(ok=False, reason="its forward has no loop over self.layers")
    if len(loops) > 1:
        return LayerLoop(ok=False, line=loops[1].lineno,
                         reason=f"its forward loops over self.layers {len(loops)} times; the layer ids are ambiguous")
    loop = loops[0]
    form = ast.unparse(loop.iter)
    outer = next((n for n in nodes if isinstance(n, (ast.For, ast.While)) and n is not loop
                  and any(m is loop for m in ast.walk(n))), None)
    if outer is not None:
        head = ast.unparse(outer.iter if isinstance(outer, ast.For) else outer.test)
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer loop runs inside another loop (over `{head}`): the layers run several "
                                "times per forward, so a layer id names no single point of the residual stream")
    found = _unwrap_iterable(loop.iter)
    if found is None:
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer loop iterates `{form}`, not self.layers, a slice of it or islice")
    layer = _loop_names(loop.target)
    if layer is None:
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer loop binds `{ast.unparse(loop.target)}`, not one layer name")
    calls = _layer_calls(loop.body, layer)
    if len(calls) != 1:
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer loop calls `{layer}(...)` {len(calls)} times; expected exactly once")
    call = calls[0]
    if not (isinstance(call, ast.Assign) and len(call.targets) == 1 and isinstance(call.value, ast.Call)
            and isinstance(call.value.func, ast.Name) and call.value.func.id == layer):
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer call `{_first_line(call)}` is not `hidden[, residual] = {layer}(...)`")
    target = call.targets[0]
    names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
    if not names or len(names) > 2 or not all(isinstance(n, ast.Name) for n in names):
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer call assigns `{ast.unparse(target)}`, not (hidden_states[, residual])")
    hidden = names[0].id  # type: ignore[union-attr]
    used = {n.id for n in ast.walk(call.value) if isinstance(n, ast.Name)}
    residual_arg = _argument_slot(call.value, names[1].id) if len(names) == 2 else None  # type: ignore[union-attr]
    # A second output is the residual only when the loop feeds it back into the next layer; one it discards
    # (`hidden_states, _ = layer(...)`: SigLIP, Gemma-4 DSpark) is not part of the next layer's input.
    residual = names[1].id if len(names) == 2 and names[1].id in used else None  # type: ignore[union-attr]
    if hidden not in used:
        return LayerLoop(ok=False, line=loop.lineno, form=form,
                         reason=f"its layer call does not pass `{hidden}` back in; not a residual-stream loop")
    return LayerLoop(ok=True, form=form, start=found[1], hidden=hidden, residual=residual, line=loop.lineno,
                     residual_arg=residual_arg if residual is not None else None,
                     hidden_arg=_argument_slot(call.value, hidden))


def _argument_slot(call: ast.Call, name: str) -> int | str | None:
    """Where ``name`` is passed in ``call``: its position, or its keyword (None if not passed as itself)."""
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Name) and arg.id == name:
            return i
    for kw in call.keywords:
        if kw.arg is not None and isinstance(kw.value, ast.Name) and kw.value.id == name:
            return kw.arg
    return None


# What a decoder layer does with the residual its loop feeds it (residual_convention).
FUSED = "fused add-norm"  # reads it: the stream at the layer's input is hidden + residual
DISCARDS = "discards the residual"  # post-LN, parallel blocks: the stream is the hidden state it is fed


@dataclass
class ResidualUse:
    """What one decoder layer's ``forward`` does with its ``residual`` argument (:func:`residual_convention`)."""

    convention: str  # FUSED, DISCARDS, or "" when the code does not tell
    why: str  # one line: the statement that decides it, or why nothing does

    @property
    def known(self) -> bool:
        return bool(self.convention)


def _loads(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


def _stores(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(node))


def _is_fused_norm_call(stmt: ast.stmt, hidden: str, residual: str) -> bool:
    """``hidden, residual = self.<norm>(hidden, residual)``: vLLM's fused add-norm (the norm adds the residual)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)):
        return False
    outs = [e.id for e in stmt.targets[0].elts if isinstance(e, ast.Name)]
    call = stmt.value
    if outs != [hidden, residual] or not isinstance(call, ast.Call) or call.keywords:
        return False
    args = [a.id for a in call.args if isinstance(a, ast.Name)]
    return args == [hidden, residual] and isinstance(call.func, ast.Attribute) and ast.unparse(
        call.func.value) == "self"


def _none_test(test: ast.expr, name: str) -> str | None:
    """"is" / "is not" for ``name is None`` / ``name is not None``; None for any other test."""
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name
            and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        if isinstance(test.ops[0], ast.Is):
            return "is"
        if isinstance(test.ops[0], ast.IsNot):
            return "is not"
    return None


def residual_convention(source: str, slot: int | str, hidden_slot: int | str | None) -> ResidualUse:
    """What the decoder layer's ``forward`` in ``source`` does with the residual passed at ``slot`` (the loop's
    argument position, or keyword; the hidden state at ``hidden_slot``), decided from the first statement that
    touches it:

    - it assigns the parameter from something else before ever reading it (``residual = hidden_states``: post-LN
      and parallel blocks, Exaone-4, PhiMoE, Cohere): the layer discards what the loop feeds it, so the residual
      stream at its input is the hidden state alone (DISCARDS);
    - it reads it in vLLM's fused add-norm form, ``if residual is None: residual = hidden; ... else: hidden,
      residual = self.norm(hidden, residual)`` (or that call alone): the stream is hidden + residual (FUSED);
    - it never mentions it: DISCARDS;
    - anything else: not known (``convention`` ""), with the statement in ``why``. Never a guess.
    """
    func = _function(source)
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    if params and params[0] == "self":
        params = params[1:]
    names = params + [a.arg for a in func.args.kwonlyargs]

    def param(at: int | str | None) -> str | None:
        if isinstance(at, int):
            return params[at] if at < len(params) else None
        return at if at in names else None

    name, hidden = param(slot), param(hidden_slot)
    if name is None or hidden is None:
        return ResidualUse("", f"its forward's parameters {names} do not match the loop's call (*args or a wrapper)")
    for stmt in func.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        if not (_loads(stmt, name) or _stores(stmt, name)):
            continue
        line = _first_line(stmt)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and not _loads(stmt, name):
            return ResidualUse(DISCARDS, f"`{line}` overwrites `{name}` before reading it")
        if _is_fused_norm_call(stmt, hidden, name):
            return ResidualUse(FUSED, f"`{line}` adds `{name}` in the fused norm")
        if isinstance(stmt, ast.If) and _none_test(stmt.test, name) is not None:
            given = stmt.orelse if _none_test(stmt.test, name) == "is" else stmt.body
            first = next((s for s in given if _loads(s, name) or _stores(s, name)), None)
            if first is not None and _is_fused_norm_call(first, hidden, name):
                return ResidualUse(FUSED, f"`{_first_line(first)}` adds `{name}` in the fused norm")
        return ResidualUse("", f"`{line}`: not a pattern whose stream is known (fused add-norm, or overwritten "
                               "before it is read)")
    return ResidualUse(DISCARDS, f"its forward never reads `{name}`")


class _Returns(ast.NodeTransformer):
    """``return x`` -> ``return _eagle3lab_aux_out(x, _eagle3lab_aux)``, outside nested functions."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node  # nested: not ours

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        value = node.value if node.value is not None else ast.Constant(None)
        call = ast.Call(ast.Name(OUT_HELPER, ast.Load()), [value, ast.Name(AUX, ast.Load())], [])
        return ast.copy_location(ast.Return(call), node)


def _stmts(code: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(code)).body


def rewrite_forward(source: str, loop: LayerLoop | None = None) -> str:
    """The forward in ``source`` with EAGLE-3 aux collection added (vLLM's id semantics), as source text.

    For a global layer id k in ``self.aux_hidden_state_layers`` it collects the stream at the input of layer k
    (``hidden + residual``; ``hidden`` where residual is None or absent, or where the layers discard the
    residual they are fed: ``loop.stream_adds_residual`` False); the id one past the loop's last
    layer gives the final pre-norm state. States come back in ascending id order, as vLLM's own forwards give
    them, and the forward returns ``(hidden_states, aux)`` whenever aux is not empty (a tensor result only:
    pipeline hand-offs pass through). ValueError when the loop is not one :func:`analyse_forward` accepts.
    """
    loop = loop or analyse_forward(source)
    if not loop.ok or loop.collects_aux:
        raise ValueError(f"cannot rewrite this forward: {loop.reason}")
    func = _function(source)
    residual = loop.residual if loop.residual and loop.stream_adds_residual else "None"
    state = f"{STATE_HELPER}({loop.hidden}, {residual})"
    own = _own_nodes(func)
    target = next(n for n in own if isinstance(n, ast.For) and n.lineno == loop.line)
    collect = _stmts(f"""
        if {COUNTER} in self.aux_hidden_state_layers:
            {AUX}.append({state})
        {COUNTER} += 1
    """)
    target.body[0:0] = collect  # first in the body: a `continue` later in it cannot skip the count
    func.body = [_Returns().visit(stmt) for stmt in func.body]  # the function itself is not visited: its body is
    parent_body = _body_holding(func, target)
    at = parent_body.index(target)
    parent_body[at:at] = _stmts(f"{COUNTER} = {loop.start}")
    parent_body[at + 2 : at + 2] = _stmts(f"""
        if {COUNTER} in self.aux_hidden_state_layers:
            {AUX}.append({state})
    """)
    func.body[0:0] = _stmts(f"{AUX} = []")
    if func.body[1:] and isinstance(func.body[1], ast.Expr) and isinstance(getattr(func.body[1], "value", None),
                                                                           ast.Constant):
        func.body[0], func.body[1] = func.body[1], func.body[0]  # keep the docstring first
    func.decorator_list = []
    ast.fix_missing_locations(func)
    return ast.unparse(func) + "\n"


def _body_holding(func: ast.FunctionDef, stmt: ast.stmt) -> list[ast.stmt]:
    """The statement list (of ``func`` or a block inside it) that holds ``stmt`` directly."""
    for node in [func, *ast.walk(func)]:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(s is stmt for s in block):
                return block
    raise ValueError("loop not found in its function")


def aux_out(result: Any, aux: list[Any]) -> Any:
    """What the rewritten forward returns: ``(hidden_states, aux)`` for a tensor result with aux, else as is."""
    if aux and hasattr(result, "shape") and hasattr(result, "dtype"):
        return result, aux
    return result


def aux_state(hidden: Any, residual: Any) -> Any:
    """The residual stream at a layer's input: ``hidden + residual``, or ``hidden`` before the first layer."""
    return hidden if residual is None else hidden + residual
