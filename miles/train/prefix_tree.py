"""Prefix-shared ("tree") training: the rows of a micro-batch that begin with the same tokens (a GRPO group's
prompt, the earlier turns of a trajectory split into turn rows) packed so that each shared token is computed once.

The rows, sorted lexicographically, become the root-to-leaf paths of a trie laid out in depth-first order, one
trie per packed row (*bin*). A node attends to exactly its ancestors and itself (an ``[N, N]`` mask per bin) at its
depth in the rows as its position id, so its hidden state is the one every row through it computes unshared; one
forward serves every row, and the backward sums each shared node's gradient over the rows that use it. The per-row
``[B, L-1]`` log-probs, entropy and values are gathered back from the nodes, so loss masks, advantages, old and
reference log-probs and metrics see the unshared layout. With routing replay a trie node is a (token, replayed
experts) pair: rows whose replayed routing differs at a token part there.

Bins: the packed batch ``[T, N]`` is the cheapest of a range of tree sizes by the model's :class:`PackCosts` (dense
work per token, attention work per pair) among those that take no more memory than the padded ``[B, L]``: no more
tokens, and no larger attention area (eager: a score per pair and head) or a mask within the activations the saved
tokens free (sdpa: no scores kept).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from miles.lazy import lazy_module
from miles.models.sampling import distribution_logits
from miles.train.kernels import LogprobKernel, TorchKernel
from miles.types import TokenSampling

np = lazy_module("numpy")
torch = lazy_module("torch")
# its autograd Function subclasses torch's at import: read when a tree forward runs, not when the options are parsed
chunked = lazy_module("miles.train.logprobs")

__all__ = ["SHARE_PREFIXES", "AUTO_MAX_WORK_FRACTION", "PackCosts", "TreePack", "PrefixSharing", "pack_rows",
           "parse_share_prefixes", "sharing_problem"]

SHARE_PREFIXES = ("auto", "true", "false")
# `auto` shares a micro-batch when the packed forward's work (PackCosts: tokens, and attention pairs weighted by the
# model's size) is at most this share of the padded rows': below ~25% saved, the mask (which takes attention off its
# maskless causal kernel), the packing and the gathers cost about what sharing saves.
AUTO_MAX_WORK_FRACTION = 0.75
# HF attention implementations that take a user-given 4D mask as it is (flash-attention kernels take none).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def parse_share_prefixes(value: Any) -> str:
    """``backend.share_prefixes`` as one of :data:`SHARE_PREFIXES` (YAML reads true/false as booleans)."""
    text = str(value).lower() if isinstance(value, (bool, str)) else None
    if text not in SHARE_PREFIXES:
        raise ValueError(f"share_prefixes must be auto, true or false, got {value!r}")
    return text


def sharing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run a tree (None: it can): it must be an HF decoder whose attention takes a 4D mask and
    whose layers all attend to the whole context."""
    return config_sharing_problem(getattr(model, "config", None), type(model).__name__)


def config_sharing_problem(config: Any, name: str) -> str | None:
    """:func:`sharing_problem` from a model's config alone (before it is loaded: an attention implementation not
    chosen yet is taken as the default, sdpa)."""
    if config is None or getattr(config, "is_encoder_decoder", False):
        return f"{name} is not an HF decoder-only model"
    if getattr(config, "vision_config", None) is not None:
        return f"{name} is a vision-language model, whose multimodal positions a tree does not carry"
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        return (f"{name} runs attention_implementation {implementation!r}, which takes no tree mask; load it with "
                f"sdpa or eager")
    windowed = [kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"]
    if windowed or (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return f"{name} has sliding-window attention layers, which a tree mask would override"
    return None


@dataclass
class TreePack:
    """A micro-batch's rows as tries: ``T`` packed rows (bins) of ``N`` nodes each (right-padded)."""

    input_ids: torch.Tensor  # [T, N] each node's token (padding: pad_token_id)
    position_ids: torch.Tensor  # [T, N] each node's depth in its rows (padding: 0)
    subtree_end: torch.Tensor  # [T, N] depth-first order: node k attends node m iff m <= k < subtree_end[m]
    node_of: torch.Tensor  # [B, L] the flat index (bin x N + node) of each row position (row padding: 0)
    routed_experts: torch.Tensor | None  # [T, N, ids per token] the replayed experts of each node (-1: none)
    padded_tokens: int  # B x L: what the unshared forward runs
    cost_ratio: float = 1.0  # the packed forward's work over the unshared one's (PackCosts)

    @property
    def tokens(self) -> int:
        """Tokens the packed forward runs (``T x N``)."""
        return self.input_ids.numel()

    def model_inputs(self, model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        """The forward's arguments: tokens, position ids, and the tree mask in the form the model's attention takes
        (boolean for sdpa, additive float for eager, which adds it to the scores)."""
        end = self.subtree_end.to(device)
        index = torch.arange(end.shape[1], device=device)
        allowed = (index[None, None, :] <= index[None, :, None]) & (index[None, :, None] < end[:, None, :])
        mask = allowed.unsqueeze(1)  # [T, 1, N (queries), N (keys)]
        if model.config._attn_implementation == "eager":
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
        return {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
                "attention_mask": mask}

    def logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor, with_entropy: bool = False,
                 entropy_grad: bool = False, *, chunk_tokens: int = 0, kernel: LogprobKernel | None = None,
                 sampling: TokenSampling | None = None):
        """:func:`miles.train.logprobs.token_logprobs` of the rows ``input_ids`` (``[B, L]``), from one forward of the
        tree: each distinct (node, next token, distribution) triple is one prediction *site*, scored once."""
        device = input_ids.device
        nodes = self.node_of[:, :-1].to(device)
        targets = input_ids[:, 1:]
        vocab = int(targets.max()) + 1
        keys = nodes * vocab + targets
        kinds = table = None
        if sampling is not None:  # rows may take a shared (node, token) under different temperatures
            params = torch.stack([t.double() for t in sampling.on(device) if t is not None], dim=-1)
            table, kinds = torch.unique(params.reshape(-1, params.shape[-1]), dim=0, return_inverse=True)
            keys = keys * len(table) + kinds.view(keys.shape)
        sites, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
        distribution = None
        if table is not None:
            site_params = table[sites % len(table)]
            sites = sites // len(table)
            distribution = (site_params[:, 0].float(), *((site_params[:, 1].float(), site_params[:, 2].long())
                                                          if site_params.shape[1] == 3 else (None, None)))
        site_nodes, site_targets = sites // vocab, sites % vocab
        inputs = self.model_inputs(model, device)
        if chunk_tokens > 0:
            logprobs, entropy = _chunked_sites(model, inputs, site_nodes, site_targets, chunk_tokens,
                                               kernel or TorchKernel(), entropy_grad,
                                               None if distribution is None else distribution[0])
        elif distribution is not None:
            logits = model(**inputs).logits.float().flatten(0, 1)  # [T x N, V]
            site_logits = distribution_logits(logits[site_nodes], *distribution, keep=site_targets)
            scored = chunked._gathered(site_logits, site_targets, with_entropy, entropy_grad)
            logprobs, entropy = scored if with_entropy else (scored, None)
        else:
            logits = model(**inputs).logits.float().flatten(0, 1)  # [T x N, V]
            log_norm = torch.logsumexp(logits, dim=-1)
            logprobs = logits[site_nodes, site_targets] - log_norm[site_nodes]
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    log_p = logits[site_nodes] - log_norm[site_nodes].unsqueeze(-1)
                    entropy = -(log_p.exp() * log_p).sum(dim=-1)
        rows = logprobs[inverse].view(targets.shape)
        return (rows, entropy[inverse].view(targets.shape)) if with_entropy else rows

    def values(self, critic: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """``[B, L-1]`` of a value model (column ``t``: the value at position ``t``), from one forward of the tree."""
        values = critic(**self.model_inputs(critic, device)).logits[..., 0].float().flatten()
        return values[self.node_of[:, :-1].to(device)]

    @contextlib.contextmanager
    def rows_of(self, routing: Any) -> Iterator[Any]:
        """``routing`` (a :func:`miles.models.moe.routing` block over the tree) whose record, once the block ends,
        holds each row position's expert ids and router logits as an unshared forward records them (``[B x L]``):
        the load-balancing loss and the routing figures count every row's tokens, as before."""
        with routing as record:
            yield record
        if record is not None:
            index = self.node_of.reshape(-1)
            record.ids = {layer: ids[index.to(ids.device)] for layer, ids in record.ids.items()}
            record.logits = {layer: logits[index.to(logits.device)] for layer, logits in record.logits.items()}


def _chunked_sites(model: torch.nn.Module, inputs: dict[str, torch.Tensor], site_nodes: torch.Tensor,
                   site_targets: torch.Tensor, chunk_tokens: int, kernel: LogprobKernel, entropy_grad: bool,
                   temperature: torch.Tensor | None = None):
    """Log-probs and entropy ``[sites]`` by the chunked path: the output layer runs on the sites' hidden states only,
    inside the model's forward (as :func:`miles.train.logprobs.token_logprobs` does, for FSDP2's gathered head)."""
    head = chunked.output_layer(model)

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        states = hidden.reshape(-1, hidden.shape[-1])[site_nodes]
        dtype = chunked.matmul_dtype(states, head.weight)
        logprobs, entropy = chunked.ChunkedLogprobs.apply(states, head.weight, head.bias, site_targets, chunk_tokens,
                                                          kernel, entropy_grad, dtype, temperature)
        return torch.stack([logprobs, entropy], dim=-1)

    with chunked.patched_head(head, head_forward):
        packed = model(**inputs).logits
    entropy = packed[:, 1]
    return packed[:, 0], entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach()


def _row_keys(input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None) -> torch.Tensor:
    """``[B, L]`` one id per (token, replayed experts) pair, -1 past each row's end: what two rows must hold alike
    at a position to share it."""
    keys = input_ids.long()
    if routed_experts is not None:
        pairs = torch.cat([keys.unsqueeze(-1), routed_experts.long()], dim=-1).reshape(-1, routed_experts.shape[-1] + 1)
        keys = torch.unique(pairs, dim=0, return_inverse=True)[1].view(keys.shape)
    width = keys.shape[1]
    return torch.where(torch.arange(width)[None, :] < lengths[:, None], keys, -1)


def _bins(lengths: list[int], shared: list[int], capacity: int) -> list[tuple[int, int]]:
    """Consecutive runs of the sorted rows whose tries hold at most ``capacity`` nodes (a longer row alone)."""
    bins, start, size = [], 0, 0
    for i, length in enumerate(lengths):
        grow = length if i == start else length - shared[i]
        if i > start and size + grow > capacity:
            bins.append((start, i))
            start, size, grow = i, 0, length
        size += grow
    bins.append((start, len(lengths)))
    return bins


def _bin_nodes(lengths: list[int], grown: list[int], span: tuple[int, int]) -> int:
    """The nodes of the bin of sorted rows ``span``: its first row whole, then what each row adds
    (``grown[i]``: the new tokens of rows before ``i``)."""
    return lengths[span[0]] + grown[span[1]] - grown[span[0] + 1]


@dataclass(frozen=True)
class PackCosts:
    """What packing weighs, relative to one token through the model's dense layers.

    ``pair_weight``: the attention work of one (query, key) pair. ``activation_bytes``: a lower bound on the bytes of
    activations a token keeps for the backward pass (None: bound the attention area instead, ``T x N^2 <= B x L^2``,
    as an eager attention's scores, one per pair and head, need)."""

    pair_weight: float = 0.0
    activation_bytes: float | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> "PackCosts":
        """An HF decoder's (hidden size ``h``, MLP width ``i``): dense work per token ``4 h^2 + 3 h i`` (attention
        projections, the MLP), attention work per pair ``2 h``; under sdpa (no scores kept) an activation bound of
        four hidden-size and two MLP-width float32 vectors per layer and token (a decoder layer keeps about ten and
        four), under eager the area bound."""
        config = model.config
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        activations = None if config._attn_implementation == "eager" else 4.0 * (4 * hidden + 2 * inner) * layers
        return cls(2 * hidden / (4 * hidden ** 2 + 3 * hidden * inner), activations)

    def packed(self, bins: int, nodes: int) -> float:
        return bins * nodes + self.pair_weight * bins * nodes ** 2

    def unshared(self, rows: int, width: int) -> float:
        """The padded rows' cost: a causal attention skips the pairs above the diagonal."""
        return rows * width + self.pair_weight * rows * width ** 2 / 2

    def fits(self, bins: int, nodes: int, rows: int, width: int) -> bool:
        """Whether ``bins`` trees of ``nodes`` take no more memory than the padded rows: no more tokens, and either
        no larger attention area or a mask (taken at 8 bytes a pair: the boolean mask and a float copy a kernel may
        make) within the activations the saved tokens free."""
        saved = rows * width - bins * nodes
        if saved < 0:
            return False
        if self.activation_bytes is None:
            return bins * nodes ** 2 <= rows * width ** 2
        return 8 * bins * nodes ** 2 <= self.activation_bytes * saved


def _choose_bins(lengths: list[int], shared: list[int], width: int,
                 costs: PackCosts) -> tuple[list[tuple[int, int]], int]:
    """The cheapest bins (by ``costs``) that fit in the padded rows' memory, and their largest node count; capacities
    from the longest row to the whole trie, in steps of sqrt(2)."""
    rows = len(lengths)
    grown = [0]
    for length, common in zip(lengths, shared):
        grown.append(grown[-1] + length - common)
    total = _bin_nodes(lengths, grown, (0, rows))
    capacities, capacity = {total}, float(max(width, 1))
    while capacity < total:
        capacities.add(int(capacity))
        capacity *= 2 ** 0.5
    best, best_cost = None, None
    for capacity in sorted(capacities):
        bins = _bins(lengths, shared, capacity)
        longest = max(_bin_nodes(lengths, grown, span) for span in bins)
        cost = costs.packed(len(bins), longest)
        if costs.fits(len(bins), longest, rows, width) and (best_cost is None or cost < best_cost):
            best, best_cost = (bins, longest), cost
    return best or ([(i, i + 1) for i in range(rows)], max(lengths))


def pack_rows(input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None,
              pad_token_id: int = 0, costs: PackCosts = PackCosts()) -> TreePack:
    """The :class:`TreePack` of right-padded rows ``input_ids`` (``[B, L]``, ``lengths`` tokens each), keyed on the
    replayed experts too when ``routed_experts`` (``[B, L, ids per token]``) is given, binned by ``costs`` (by
    default: fewest tokens within the padded rows' tokens and attention area)."""
    rows, width = input_ids.shape
    lengths = lengths.long().cpu()
    keys = _row_keys(input_ids.cpu(), lengths, None if routed_experts is None else routed_experts.cpu())
    order = sorted(range(rows), key=lambda r: keys[r, : int(lengths[r])].tolist())
    ordered = keys[order]
    same = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    shared = [0] + same.long().cumprod(dim=1).sum(dim=1).tolist()
    sorted_lengths = [int(lengths[r]) for r in order]
    bins, nodes = _choose_bins(sorted_lengths, shared, width, costs)
    nodes = max(nodes, 1)
    ids: list[int] = []  # flat [T x N] lists, made tensors at the end
    positions: list[int] = []
    end: list[int] = []
    node_of = [0] * (rows * width)
    experts = None
    if routed_experts is not None:
        experts = torch.full((len(bins), nodes, routed_experts.shape[-1]), -1, dtype=routed_experts.dtype)
    tokens_of = input_ids.cpu().tolist()
    for b, (first, last) in enumerate(bins):
        tokens, depths, ends, path = [], [], [], []
        for i in range(first, last):
            row, length = order[i], sorted_lengths[i]
            keep = 0 if i == first else shared[i]
            for node in path[keep:]:  # the previous row's nodes below the shared part: their subtrees are done
                ends[node] = len(tokens)
            count = len(tokens)
            path = path[:keep] + list(range(count, count + length - keep))
            tokens += tokens_of[row][keep:length]
            depths += range(keep, length)
            ends += [0] * (length - keep)
            if experts is not None:
                experts[b, count: len(tokens)] = routed_experts[row, keep:length].cpu()
            base = b * nodes
            node_of[row * width: (row + 1) * width] = [base + node for node in path] + [base] * (width - length)
        for node in path:
            ends[node] = len(tokens)
        padding = nodes - len(tokens)
        ids += tokens + [pad_token_id] * padding
        positions += depths + [0] * padding
        end += ends + list(range(len(tokens) + 1, nodes + 1))  # padding attends to itself only
    shape = (len(bins), nodes)
    return TreePack(_tensor(ids).to(input_ids.dtype).view(shape), _tensor(positions).view(shape),
                    _tensor(end).view(shape), _tensor(node_of).view(rows, width), experts, rows * width,
                    costs.packed(len(bins), nodes) / costs.unshared(rows, width))


def _tensor(values: list[int]) -> torch.Tensor:
    """A long tensor of a flat list of ints, through numpy (several times faster than ``torch.tensor``)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


class PrefixSharing:
    """``backend.share_prefixes`` for one process's models: whether, and how, each micro-batch is packed.

    ``true`` refuses at start a model that cannot take a tree mask and packs every micro-batch; ``auto`` packs one
    when the models can and the packed work is at most :data:`AUTO_MAX_WORK_FRACTION` of the unshared work, and
    never with ``exact_logprobs`` (whose per-row path is bit-identical to the engine's whatever the batch); ``false``
    never packs."""

    def __init__(self, mode: Any, models: list[torch.nn.Module], *, exact_logprobs: bool = False,
                 routing_replay: bool = False, pad_token_id: int = 0) -> None:
        self.mode = parse_share_prefixes(mode)
        problems = [problem for problem in map(sharing_problem, models) if problem]
        if self.mode == "true" and problems:
            raise ValueError(f"share_prefixes: true: {'; '.join(problems)}; set share_prefixes to auto (falls back to "
                             f"unshared) or false")
        self.enabled = self.mode == "true" or (self.mode == "auto" and not problems and not exact_logprobs)
        self.routing_replay, self.pad_token_id = routing_replay, pad_token_id
        self.costs = PackCosts.of(models[0]) if self.enabled and models else PackCosts()
        self._last: tuple[Any, TreePack | None] | None = None

    def pack(self, micro: Any) -> TreePack | None:
        """The tree of ``micro`` (a :class:`miles.types.TrainBatch`), or None to run it unshared; kept for the
        micro-batch's next forward (the reference model's, the routing's)."""
        if not self.enabled:
            return None
        if self._last is not None and self._last[0] is micro:
            return self._last[1]
        routed = micro.routed_experts if self.routing_replay else None  # replayed experts are part of a node
        pack = pack_rows(micro.input_ids, micro.attention_mask.sum(dim=1), routed, self.pad_token_id, self.costs)
        if self.mode == "auto" and pack.cost_ratio > AUTO_MAX_WORK_FRACTION:
            pack = None
        self._last = (micro, pack)
        return pack
