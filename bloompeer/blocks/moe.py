"""Sparse mixtures of experts: a block's MLP as a router that picks k of a layer's E experts for each
token (and, in some variants, a shared expert every token also goes through), as transformers
computes it (`integrations/moe.py`, the grouped kernel it uses by default, and each model's router).

Why this shape: a decode step must read only the experts its tokens chose, not all E. So a pass sorts
its (token, slot) pairs by expert and runs one matrix product per expert that has rows, through the
span's `linear` seam like every other layer (the batched-pass kernel, quantized experts); a prompt or a
pass of several sessions' steps is still one product per expert, never one per token. The k outputs of
a token are then weighted and summed in top-k slot order, as transformers sums them, so that float32
results stay within rounding of its own whatever k is. A static step (a CUDA graph's, blocks/step_graphs.py)
cannot size those products on the host: there the experts are stacked (`stack`) and every chosen expert's
rows go through one grouped product per layer, its group ends found on the device (`_grouped`). Experts that
cannot be stacked (quantized, or not bfloat16 on a GPU) compute there every expert over all the rows and keep
each row's chosen expert's output (`_every_expert`), when the pass has rows enough for that to read at most
about twice the weights its eager pass would (`static_refusal`).

The router runs on each request's rows alone (`rows`): a token's experts never depend on which other
sessions share the pass. Routers stay in the model's dtype under `--quant` (a quantized router picks
other experts), so they are not nn.Linear layers: quantization and the batched-pass kernel take those.

DeepSeek-V3's router (`GroupLimitedRouter`, GLM-4.5's too) scores experts by the sigmoid of float32
logits and chooses among the best groups with a correction bias that the weights never see; its shared
experts are a dense MLP every token goes through, added unweighted.

Experts are per-expert nn.Linear layers named as hub checkpoints name them (`experts.{j}.gate_proj`,
Mixtral's `experts.{j}.w1`), which quantization, the batched-pass kernel and the memory plan already
know; gpt-oss ships its experts fused, and `split_fused_experts` cuts them apart as a block loads.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from .span import Linear

__all__ = [
    "GptOssExpert", "GroupLimitedRouter", "MixtralExpert", "Router", "SparseMoe", "softmax_then_top_k",
    "split_fused_experts", "split_stacked_experts", "top_k_then_softmax",
]

Choice = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (logits [T, E], k) -> weights, experts
# True while a static step runs (step_graphs.StaticStep.run): experts then compute without reading the host,
# stacked ones in one grouped product per layer, others every expert over all the rows (SparseMoe._routed)
GROUPED_EXPERTS: ContextVar[bool] = ContextVar("grouped_experts", default=False)


class Router(nn.Module):
    """logits = x W^T (+ b): a plain parameter, not an nn.Linear, so that it is never quantized."""

    def __init__(self, hidden: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """[T, E] for hidden [T, H], each request's rows alone (as its own pass would compute them)."""
        if len(rows) == 1:
            return F.linear(hidden, self.weight, self.bias)
        return torch.cat([F.linear(part, self.weight, self.bias) for part in hidden.split(rows)])


class GroupLimitedRouter(Router):
    """DeepSeek-V3's router (DeepseekV3TopkRouter; GLM-4.5's is the same), as transformers computes it:
    sigmoid scores of float32 logits; `e_score_correction_bias` added to choose, never to weigh; experts
    in `num_groups` groups, each scored by its two best, the `top_groups` best groups kept, and the k best
    experts of those (in topk's unsorted order, which sets the order of the slots' sum); the weights are
    the chosen experts' scores, divided by their sum (+ 1e-20) if `renormalize`, times `scaling`.
    Everything stays float32: its weight and correction bias are held in float32 whatever dtype the block is
    served in (`float32_parameters`, as transformers' _keep_in_fp32_modules_strict keeps them), so that a
    bfloat16 server chooses the experts transformers' bfloat16 model chooses."""

    float32_parameters = ("weight", "e_score_correction_bias")

    def __init__(self, hidden: int, num_experts: int, num_groups: int, top_groups: int, renormalize: bool,
                 scaling: float):
        super().__init__(hidden, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.num_groups, self.top_groups, self.renormalize, self.scaling = num_groups, top_groups, renormalize, scaling

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        weight = self.weight.float()
        return torch.cat([F.linear(part.float(), weight) for part in hidden.split(rows)])

    def choose(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()  # [T, E]
        for_choice = scores + self.e_score_correction_bias
        grouped = for_choice.view(-1, self.num_groups, for_choice.shape[-1] // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        groups = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, for_choice.shape[-1])
        for_choice = for_choice.masked_fill(~expert_mask.bool(), float("-inf"))
        experts = torch.topk(for_choice, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scaling, experts


def softmax_then_top_k(renormalize: bool, weights_dtype_of_logits: bool) -> Choice:
    """Mixtral's and the Qwen MoEs' choice: softmax over all experts in float32, the k largest, their
    weights renormalized to sum to 1 or not (`norm_topk_prob`; Mixtral always), and kept in float32
    (Mixtral) or cast back to the logits' dtype (Qwen)."""

    def choose(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k, dim=-1)
        if renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if weights_dtype_of_logits else weights), experts

    return choose


def top_k_then_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's choice: the k largest logits (with the router's bias), then a softmax over those k."""
    top, experts = torch.topk(logits, k, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype), experts


class MixtralExpert(nn.Module):
    """One of Mixtral's experts, under its checkpoint names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.w2 = nn.Linear(intermediate, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, intermediate, bias=False)  # up

    def compute(self, hidden: torch.Tensor, linear: Linear) -> torch.Tensor:
        return linear(self.w2, F.silu(linear(self.w1, hidden)) * linear(self.w3, hidden))


class GptOssExpert(nn.Module):
    """One of gpt-oss's experts: gate and up interleaved in one layer (gate at even outputs), both
    clamped at `limit`, (up + 1) * gate * sigmoid(alpha * gate), then down; every layer has a bias."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)
        self.alpha, self.limit = alpha, limit

    def compute(self, hidden: torch.Tensor, linear: Linear) -> torch.Tensor:
        gate_up = linear(self.gate_up_proj, hidden)
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return linear(self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class SparseMoe(nn.Module):
    """A block's sparse MLP: `router_name` (gate or router) picks `top_k` of `experts` per token with
    `choose` (None: the router's own `choose`); with a shared expert, every token also goes through it,
    added after the routed experts' sum: weighted by sigmoid(shared_expert_gate(x)) under Qwen2-MoE's
    name `shared_expert`, unweighted under DeepSeek-V3's `shared_experts`."""

    def __init__(self, router_name: str, router: Router, experts: list[nn.Module], top_k: int, choose: Choice | None,
                 shared_expert: nn.Module | None = None, shared_name: str = "shared_expert"):
        super().__init__()
        self.router_name, self.top_k, self.choose = router_name, top_k, choose or router.choose
        self.add_module(router_name, router)
        self.experts = nn.ModuleList(experts)
        self.shared_name = shared_name if shared_expert is not None else None
        if shared_expert is not None:
            self.add_module(shared_name, shared_expert)
        if shared_name == "shared_expert" and shared_expert is not None:
            self.shared_expert_gate = Router(router.weight.shape[1], 1)
        # the first expert's layer -> every expert's (weights [E, out, in], biases [E, out] or None), once stacked
        self.stacked: dict[nn.Module, tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def stack(self) -> None:
        """Hold each expert layer's weights as one [E, out, in] tensor (each expert's nn.Linear a view of
        it, so no memory is added), for static steps: a CUDA graph cannot run one product per expert
        chosen, since which ones and how many rows each gets are read on the host; one grouped product
        over all E, its group ends computed on the device, can. Quantized experts (not nn.Linear) stay
        as they are, and a static step computes every one of them (`_every_expert`, where the pass has rows
        enough: static_refusal); so do experts in another dtype than bfloat16 off the CPU, which
        torch._grouped_mm does not take there (float32 only on the CPU, where the tests run it)."""
        first = self.experts[0]
        names = [name for name, _ in first.named_children()]
        if not all(type(getattr(expert, name)) is nn.Linear for expert in self.experts for name in names):
            return
        weight = getattr(first, names[0]).weight
        if weight.device.type != "cpu" and weight.dtype != torch.bfloat16:
            return
        stacked = {}
        for name in names:
            layers = [getattr(expert, name) for expert in self.experts]
            weights = torch.stack([layer.weight.detach() for layer in layers])
            biases = None if layers[0].bias is None else torch.stack([layer.bias.detach() for layer in layers])
            for index, layer in enumerate(layers):
                layer.weight = nn.Parameter(weights[index], requires_grad=layer.weight.requires_grad)
                if biases is not None:
                    layer.bias = nn.Parameter(biases[index], requires_grad=layer.bias.requires_grad)
            stacked[layers[0]] = (weights, biases)
        self.stacked = stacked

    def static_refusal(self, rows: int) -> str | None:
        """Why this MLP cannot run in a static step of `rows` rows (BlockSpan.static_step_refusal), or None.

        Stacked experts always can: their grouped product reads each chosen expert once, as the eager pass
        does. Experts that are not stacked compute every one of the E experts over all the rows
        (`_every_expert`), so such a step reads all E experts' weights where the eager pass reads at most
        min(E, rows * top_k). A decode step is bound by its weight reads, and what a graph saves is its
        launches; so the every-expert form is taken only while it reads at most about twice what an eager
        pass of as many rows reads when their choices differ, E <= 2 * rows * top_k (a bound chosen, not
        measured: Mixtral's 8 experts of 2 qualify from 2 rows, DeepSeek-V3's 256 of 8 from 16), and a pass
        of fewer rows runs eagerly."""
        experts, chosen = len(self.experts), rows * self.top_k
        if self.stacked is not None or experts <= 2 * chosen:
            return None
        return (f"its {experts} experts are not stacked (quantized, or not bfloat16 on a GPU: SparseMoe.stack), "
                f"and a static step would read all {experts} of them, more than twice the {chosen} that an eager "
                f"pass reads at most ({rows} row{'s' if rows > 1 else ''} of {self.top_k} choices)")

    def compute(self, hidden: torch.Tensor, linear: Linear, rows: list[int]) -> torch.Tensor:
        """hidden [rows..., H] (normed) -> [rows..., H]; rows: each request's row count in the pass."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
        shared = self._modules[self.shared_name].compute(flat, linear) if self.shared_name else None
        weights, experts = self.choose(self._modules[self.router_name].logits(flat, rows), self.top_k)  # [T, k]
        output = self._routed(flat, weights, experts, linear)
        if hasattr(self, "shared_expert_gate"):
            shared = torch.sigmoid(self.shared_expert_gate.logits(flat, rows)) * shared
        return (output if shared is None else output + shared).view_as(hidden)

    def _routed(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                linear: Linear) -> torch.Tensor:
        """sum over slots s of weights[:, s] * expert[experts[:, s]](x): one product per chosen expert."""
        num_tokens, k = experts.shape
        slots = experts.reshape(-1)  # [T * k], token-major
        grouped_slots, order = torch.sort(slots)  # slots grouped by expert, in the order transformers groups them
        grouped_rows = flat[order // k]
        if not GROUPED_EXPERTS.get():
            outputs = self._one_product_per_expert(grouped_rows, slots, linear)
        elif self.stacked is not None:
            outputs = self._grouped(grouped_rows, grouped_slots)
        else:
            outputs = self._every_expert(grouped_rows, grouped_slots, linear)
        weighted = outputs * weights.reshape(-1)[order, None]  # in the weights' dtype (float32 for Mixtral)
        in_slot_order = torch.empty_like(weighted)
        in_slot_order[order] = weighted
        return in_slot_order.view(num_tokens, k, -1).sum(dim=1).to(flat.dtype)

    def _one_product_per_expert(self, grouped_rows: torch.Tensor, slots: torch.Tensor, linear: Linear) -> torch.Tensor:
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        outputs = torch.empty_like(grouped_rows)
        start = 0
        for index, count in enumerate(counts):
            if count:
                outputs[start:start + count] = self.experts[index].compute(grouped_rows[start:start + count], linear)
                start += count
        return outputs

    def _every_expert(self, grouped_rows: torch.Tensor, grouped_slots: torch.Tensor, linear: Linear) -> torch.Tensor:
        """Every expert over all the rows, each row keeping its chosen expert's output: E products of the
        pass's shapes and no host read, for experts that cannot be stacked (static_refusal says when it is
        worth the reads). torch.where picks the chosen output itself, not a sum with zeros (an inf or NaN in
        an expert's output for a row it was not chosen for stays out of that row)."""
        chosen = grouped_slots[:, None]
        outputs = self.experts[0].compute(grouped_rows, linear)
        for index in range(1, len(self.experts)):
            outputs = torch.where(chosen == index, self.experts[index].compute(grouped_rows, linear), outputs)
        return outputs

    def _grouped(self, grouped_rows: torch.Tensor, grouped_slots: torch.Tensor) -> torch.Tensor:
        """Every expert's rows through its layers in one grouped product per layer (torch._grouped_mm), group
        ends from the sorted slots on the device: no host read, the shapes of any pass of as many rows. The
        first expert's code runs once over all rows (its other ops are row by row), each of its layers standing
        for that layer of every expert."""
        experts = torch.arange(len(self.experts), device=grouped_slots.device)
        ends = torch.searchsorted(grouped_slots, experts, right=True).to(torch.int32)

        def grouped(layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
            weights, biases = self.stacked[layer]
            output = torch._grouped_mm(rows, weights.transpose(-2, -1), offs=ends)
            return output if biases is None else output + biases[grouped_slots]

        return self.experts[0].compute(grouped_rows, grouped)


def split_fused_experts(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """gpt-oss's fused expert tensors as per-expert layers: `{prefix}gate_up_proj` [E, H, 2I] (inputs
    first) and its bias [E, 2I], `{prefix}down_proj` [E, I, H] and its bias [E, H] become
    `{prefix}{j}.gate_up_proj.weight` [2I, H], ... for each expert j. Other tensors pass unchanged.

    Each weight is a transposed view of the stored one, not a copy: F.linear then multiplies by the
    very operand transformers' kernel does, so the experts' outputs are bitwise its own."""
    fused = {name: state.pop(prefix + name) for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                         "down_proj_bias") if prefix + name in state}
    for layer in ("gate_up_proj", "down_proj"):
        if layer not in fused:
            continue
        for index, weight in enumerate(fused[layer].unbind(0)):
            state[f"{prefix}{index}.{layer}.weight"] = weight.t()
        for index, bias in enumerate(fused.get(f"{layer}_bias", torch.empty(0)).unbind(0)):
            state[f"{prefix}{index}.{layer}.bias"] = bias
    return state


def split_stacked_experts(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Experts stacked as transformers holds them: `{prefix}gate_up_proj` [E, 2I, H] (each expert's gate rows,
    then its up rows) and `{prefix}down_proj` [E, H, I] become `{prefix}{j}.gate_proj.weight` [I, H],
    `.up_proj.weight` and `.down_proj.weight` for each expert j; a block stored expert by expert passes
    unchanged. Qwen3.5-MoE's checkpoints may come either way: transformers reads both (its conversion
    mapping merges per-expert tensors; stacked ones are its own parameters), so a server does too."""
    stacked = {name: state.pop(prefix + name) for name in ("gate_up_proj", "down_proj") if prefix + name in state}
    for index, weight in enumerate(stacked.get("gate_up_proj", torch.empty(0)).unbind(0)):
        state[f"{prefix}{index}.gate_proj.weight"], state[f"{prefix}{index}.up_proj.weight"] = weight.chunk(2)
    for index, weight in enumerate(stacked.get("down_proj", torch.empty(0)).unbind(0)):
        state[f"{prefix}{index}.down_proj.weight"] = weight
    return state
