"""Layer probe: how well each target layer's state alone predicts the target's next token.

For every vLLM aux id k (the residual stream at the input of decoder layer k; id L is the final state
before the last norm) two readouts through the target's own final norm and ``lm_head``:

- **logit lens**: the state as it is (no training): ``lm_head(norm(h))``. At id L it *is* the target, so its
  top-1 agreement there is 1 by construction;
- **tuned lens** (Belrose et al., 2023): a learned affine translator per layer, ``lm_head(norm(h + W h + b))``
  with W, b starting at zero, trained to minimise KL(target || probe) on the training tokens and scored on
  held-out tokens.

Labels are the target's argmax at each position (what a greedy drafter must predict), so top-1 is the
agreement with the target. The probe says where next-token information is readable; the aux-layer
ablation (:mod:`eagle3lab.ablation`) says which layers a drafter profits from. They need not agree: a
drafter reads several layers at once through its fc and predicts further ahead than one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from eagle3lab.aux_states.hooks import decoder_parts


@dataclass
class Readout:
    """The target's final norm and unembedding, as plain tensors (the model is never touched)."""

    norm_weight: torch.Tensor  # [H]
    head_weight: torch.Tensor  # [V, H]
    eps: float

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return h @ self.head_weight.T


def readout_from_model(model: Any) -> Readout:
    """Final RMSNorm weight and lm_head of a transformers causal LM (DeepseekV3ForCausalLM and kin)."""
    _, _, norm = decoder_parts(model)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return Readout(norm.weight.detach().float().cpu(), model.get_output_embeddings().weight.detach().float().cpu(), eps)


@dataclass
class ProbeResult:
    """Held-out agreement with the target's next token, per layer id."""

    layer_ids: list[int]
    top_k: int
    lens_top1: list[float]
    lens_topk: list[float]
    tuned_top1: list[float]
    tuned_topk: list[float]
    train_tokens: int
    eval_tokens: int
    steps: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[float, float]:
    top = logits.topk(k, dim=-1).indices
    return float((top[:, 0] == labels).float().mean()), float((top == labels[:, None]).any(-1).float().mean())


def fit_tuned_lens(
    states: torch.Tensor, final_states: torch.Tensor, readout: Readout, steps: int = 100, batch_size: int = 256,
    lr: float = 1e-3, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train one layer's translator (W [H, H], b [H], from zero) on ``states`` [N, H].

    The loss is the tuned lens's: KL(target || probe), the target's distribution read from the final
    states [N, H] at the same positions. At the final layer W = 0 is optimal, so the translator cannot
    drift away from the target there.
    """
    h = states.shape[-1]
    w = torch.zeros(h, h, requires_grad=True)
    b = torch.zeros(h, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, states.shape[0], (min(batch_size, states.shape[0]),), generator=g)
        x = states[idx].float()
        with torch.no_grad():
            target = F.log_softmax(readout.logits(final_states[idx]), -1)
        probe = F.log_softmax(readout.logits(x + x @ w.T + b), -1)
        loss = F.kl_div(probe, target, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return w.detach(), b.detach()


def probe_layers(
    layer_ids: Sequence[int],
    train_states: torch.Tensor,
    train_labels: torch.Tensor,
    eval_states: torch.Tensor,
    eval_labels: torch.Tensor,
    readout: Readout,
    top_k: int = 5,
    steps: int = 100,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    final_id: int | None = None,
) -> ProbeResult:
    """Logit lens and tuned lens for every layer.

    ``train_states``/``eval_states``: [N, n_layers, H] (layer j = ``layer_ids[j]``); labels: [N] the
    target's greedy next token at each position (scored as top-1 / top-k agreement). The tuned lens trains
    against the distribution read from the final state (id ``final_id``, default the last of ``layer_ids``).
    """
    import time

    if train_states.shape[1] != len(layer_ids) or eval_states.shape[1] != len(layer_ids):
        raise ValueError(f"states have {train_states.shape[1]}/{eval_states.shape[1]} layers, ids {len(layer_ids)}")
    if not len(train_labels) or not len(eval_labels):
        raise ValueError("probe_layers: no tokens to train on or to score")
    final = len(layer_ids) - 1 if final_id is None else list(layer_ids).index(final_id)
    t0 = time.perf_counter()
    res = ProbeResult(list(layer_ids), top_k, [], [], [], [], int(train_states.shape[0]),
                      int(eval_states.shape[0]), steps, 0.0)
    with torch.no_grad():
        ev = [eval_states[:, j].float() for j in range(len(layer_ids))]
    for j in range(len(layer_ids)):
        with torch.no_grad():
            t1, tk = _topk_hits(readout.logits(ev[j]), eval_labels, top_k)
        res.lens_top1.append(t1)
        res.lens_topk.append(tk)
        w, b = fit_tuned_lens(train_states[:, j], train_states[:, final], readout, steps, batch_size, lr, seed + j)
        with torch.no_grad():
            x = ev[j]
            t1, tk = _topk_hits(readout.logits(x + x @ w.T + b), eval_labels, top_k)
        res.tuned_top1.append(t1)
        res.tuned_topk.append(tk)
    res.seconds = time.perf_counter() - t0
    return res


def states_and_labels(
    aux: torch.Tensor, layer_ids: Sequence[int], hidden_size: int, readout: Readout, final_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split all-layer aux states [T, n*H] into [T, n, H] and label each position with the target's argmax.

    The label comes from the final pre-norm state (id ``final_id`` = num_layers, which must be among
    ``layer_ids``) through the readout: exactly the target's logits.
    """
    ids = list(layer_ids)
    if final_id not in ids:
        raise ValueError(f"the final state (id {final_id}) is needed for the labels; got ids {ids}")
    states = aux.reshape(aux.shape[0], len(ids), hidden_size)
    with torch.no_grad():
        labels = readout.logits(states[:, ids.index(final_id)]).argmax(-1)
    return states, labels


def probe_figure(res: ProbeResult, aux_layer_ids: Sequence[int] = ()) -> go.Figure:
    """Top-1 / top-k agreement with the target per layer id (tuned and logit lens); the drafter's ids marked."""
    x = res.layer_ids
    fig = go.Figure()
    fig.add_scatter(x=x, y=res.tuned_top1, mode="lines+markers", name="tuned lens top-1")
    fig.add_scatter(x=x, y=res.tuned_topk, mode="lines+markers", name=f"tuned lens top-{res.top_k}")
    fig.add_scatter(x=x, y=res.lens_top1, mode="lines+markers", line={"dash": "dot"}, name="logit lens top-1")
    for i in aux_layer_ids:
        fig.add_vline(x=i, line={"color": "rgba(0,0,0,0.25)", "width": 8})
    fig.update_layout(
        title=f"Layer probe: agreement with the target's next token ({res.eval_tokens} held-out tokens; "
        "shaded: the drafter's aux ids)",
        xaxis={"title": "vLLM aux id k (input of decoder layer k; last = final pre-norm state)", "dtick": 1},
        yaxis={"title": "fraction of tokens", "range": [0, 1.05]}, legend={"orientation": "h", "y": -0.25},
    )
    return fig


def sample_states(dataset: Any, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Up to ``num_tokens`` response-token rows of aux states from a hidden-state dataset (sequences in a
    seeded random order, all response tokens of each): the probe's training set."""
    g = torch.Generator().manual_seed(seed)
    rows, n = [], 0
    for i in torch.randperm(len(dataset), generator=g).tolist():
        item = dataset.get(i, ("loss_mask", "aux"))
        rows.append(item["aux"][item["loss_mask"]])
        n += len(rows[-1])
        if n >= num_tokens:
            break
    if not rows:
        raise ValueError("sample_states: the dataset is empty")
    return torch.cat(rows)[:num_tokens]
