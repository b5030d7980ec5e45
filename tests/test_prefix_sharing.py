"""Prefix-shared ("tree") training (``backend.share_prefixes``, :mod:`miles.train.prefix_tree`): the rows of a
micro-batch that share a prefix run it once, and every row's log-probs, entropy, values, gradients, routing and
updated weights equal the unshared path's."""

import json
import os
import subprocess
import sys

import pytest
import torch

from miles.builtin.advantages import grpo
from miles.models.hf import load_model
from miles.testing import build_tiny_model
from miles.train.logprobs import token_logprobs
from miles.train.losses import ppo_clip
from miles.train.options import TrainOptions
from miles.train.prefix_tree import AUTO_MAX_WORK_FRACTION, PackCosts, PrefixSharing, pack_rows
from miles.train.regularizers import regularized
from miles.train.torch_backend import Policy, TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch

TOLERANCE = 1e-5


def _tokens(gen, n):
    return torch.randint(3, 15, (n,), generator=gen).tolist()


def _batch(rows: list[tuple[list[int], list[int]]], seed: int = 0) -> TrainBatch:
    """A batch of (prompt, response) rows with GRPO advantages (groups of the same prompt)."""
    gen = torch.Generator().manual_seed(seed)
    prompts: dict[tuple, int] = {}
    samples = []
    for i, (prompt, response) in enumerate(rows):
        group = prompts.setdefault(tuple(prompt), len(prompts))
        samples.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                              rollout_logprobs=(-torch.rand(len(response), generator=gen)).tolist(), group_index=group,
                              index=i, status=SampleStatus.COMPLETED, reward=float(torch.rand((), generator=gen))))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    return batch


def single_turn_groups(seed=0):
    """Two groups of n=4 samples sharing their prompt, answers of different lengths (padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2):
        prompt = _tokens(gen, 12)
        rows += [(prompt, _tokens(gen, n)) for n in (1, 3, 6, 9)]
    return _batch(rows, seed)


def multi_turn_rows(seed=0):
    """A trajectory split into turn rows (each a prefix of the next), and a second trajectory of the same prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompt = _tokens(gen, 8)
    history, rows = list(prompt), []
    for _ in range(3):
        answer = _tokens(gen, 4)
        rows.append((list(history), answer))
        history += answer + _tokens(gen, 3)  # the answer, then the tool's observation
    rows.append((prompt, _tokens(gen, 10)))
    return _batch(rows, seed)


def partial_rows(seed=0):
    """Truncated rows: a row that is a prefix of another, two identical rows, a one-token answer, and a row that
    shares nothing with the rest."""
    gen = torch.Generator().manual_seed(seed)
    prompt, answer = _tokens(gen, 10), _tokens(gen, 8)
    lone = [3] + _tokens(gen, 6)
    rows = [(prompt, answer), (prompt, answer[:3]), (prompt, answer[:3]), (prompt, answer[:1]),
            ([4] + prompt[1:], _tokens(gen, 5)), (lone, _tokens(gen, 4))]
    return _batch(rows, seed)


WORKLOADS = {"single_turn": single_turn_groups, "multi_turn": multi_turn_rows, "partial": partial_rows}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("prefix") / "model", max_position_embeddings=256)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("prefix-moe") / "model", arch="qwen3_moe")


def _valid(batch):
    """``[B, L-1]``: the columns that predict a real token."""
    return torch.arange(batch.loss_mask.shape[1])[None, :] < (batch.attention_mask.sum(dim=1) - 1)[:, None]


def _loss_and_grads(model, batch, forward):
    """Log-probs, entropy, and the gradient of a policy-gradient loss with an entropy bonus, from ``forward``."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = forward(model, batch.input_ids, with_entropy=True, entropy_grad=True)
    loss = -(logprobs * batch.advantages * batch.loss_mask).sum() - 0.01 * (entropy * batch.loss_mask).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


def _assert_grads_close(tree, rows):
    assert tree.keys() == rows.keys() and rows
    for name, grad in rows.items():
        assert (tree[name] - grad).norm() <= TOLERANCE * max(grad.norm(), 1e-12), name


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_tree_logprobs_entropy_and_gradients_equal_the_rows(model_dir, workload, chunk_tokens, attention):
    """Every valid column's log-prob and entropy within 1e-5, every parameter's gradient within 1e-5 relative, for
    both attention implementations and both log-prob paths; the tree runs fewer tokens than the padded rows."""
    batch = WORKLOADS[workload]()
    model = load_model(model_dir)
    model.config._attn_implementation = attention
    tree = pack_rows(batch.input_ids, batch.attention_mask.sum(dim=1))
    assert tree.tokens < tree.padded_tokens
    kernel = {"chunk_tokens": chunk_tokens}
    lp_rows, ent_rows, g_rows = _loss_and_grads(model, batch, lambda *a, **k: token_logprobs(*a, **k, **kernel))
    lp_tree, ent_tree, g_tree = _loss_and_grads(model, batch, lambda *a, **k: tree.logprobs(*a, **k, **kernel))
    valid = _valid(batch)
    assert (lp_tree - lp_rows)[valid].abs().max() <= TOLERANCE
    assert (ent_tree - ent_rows)[valid].abs().max() <= TOLERANCE
    assert torch.isfinite(lp_tree).all()
    _assert_grads_close(g_tree, g_rows)


def test_each_row_reads_its_own_tokens_from_the_tree():
    """The trie's structure: shared prefixes are one node, each row's path spells the row, position ids are depths,
    and a node's subtree holds exactly the nodes below it."""
    batch = partial_rows()
    lengths = batch.attention_mask.sum(dim=1)
    tree = pack_rows(batch.input_ids, lengths)
    flat_ids, flat_pos = tree.input_ids.flatten(), tree.position_ids.flatten()
    for row, length in enumerate(lengths.tolist()):
        path = tree.node_of[row, :length]
        assert flat_ids[path].tolist() == batch.input_ids[row, :length].tolist()
        assert flat_pos[path].tolist() == list(range(length))
        bins, nodes = path // tree.input_ids.shape[1], path % tree.input_ids.shape[1]
        assert len(set(bins.tolist())) == 1
        end = tree.subtree_end[bins[0]]
        for depth in range(length):  # each node on the path is an ancestor of the ones after it
            assert bool((nodes[depth] <= nodes[depth:]).all() and (nodes[depth:] < end[nodes[depth]]).all())
    assert tree.node_of[1, 3].item() == tree.node_of[0, 3].item() == tree.node_of[2, 3].item()
    distinct = len({tuple(batch.input_ids[r, :n].tolist()[:k + 1]) for r, n in enumerate(lengths.tolist())
                    for k in range(n)})
    assert int((tree.subtree_end > 0).sum()) >= distinct  # every distinct prefix is a node


@pytest.mark.parametrize("costs", [PackCosts(), PackCosts(pair_weight=0.01, activation_bytes=2048.0)],
                         ids=["area_bound", "activation_bound"])
def test_bins_never_exceed_the_padded_batch(costs):
    """Over random batches of shared and unshared rows: the packed tokens stay within the padded rows', and the
    attention area (eager) or the mask (within the activations the saved tokens free: sdpa) within the memory bound;
    every row reads its own tokens back."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(30):
        groups, n = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen))
        rows = []
        for _ in range(groups):
            prompt = _tokens(gen, int(torch.randint(1, 40, (), generator=gen)))
            rows += [(prompt, _tokens(gen, int(torch.randint(1, 20, (), generator=gen)))) for _ in range(n)]
        batch = _batch(rows)
        lengths = batch.attention_mask.sum(dim=1)
        tree = pack_rows(batch.input_ids, lengths, costs=costs)
        bins, nodes = tree.input_ids.shape
        padded = tree.padded_tokens
        width = padded // len(rows)
        fits = (bins * nodes ** 2 <= len(rows) * width ** 2 if costs.activation_bytes is None
                else 8 * bins * nodes ** 2 <= costs.activation_bytes * (padded - bins * nodes))
        assert bins * nodes <= padded and (fits or bins == len(rows))
        flat = tree.input_ids.flatten()
        for row, length in enumerate(lengths.tolist()):
            assert flat[tree.node_of[row, :length]].tolist() == batch.input_ids[row, :length].tolist()


class SGDBackend(TorchBackend):
    """Plain SGD: updated weights differ by the learning rate times the gradients' difference. (AdamW divides each
    update by the gradient's running scale, so float noise in a near-zero gradient moves a weight by up to lr.)"""

    def build_optimizer(self, model):
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=self.options.lr)


def _steps(model_dir, share, batches, loss, setup=None, **options):
    backend = SGDBackend(lr=0.5, share_prefixes=share, **options)
    backend.setup(str(model_dir), seed=0, **(setup or {}))
    logprobs = backend.compute_logprobs(batches[0])
    metrics = [backend.train_step(batch, loss) for batch in batches]
    return logprobs, metrics, backend.export_weights(), backend


def _assert_same_run(shared, unshared, batches):
    lp_s, metrics_s, weights_s, _ = shared
    lp_u, metrics_u, weights_u, _ = unshared
    mask = batches[0].loss_mask > 0
    assert (lp_s - lp_u)[mask].abs().max() <= TOLERANCE
    for one, two in zip(metrics_u, metrics_s):
        assert one.keys() == two.keys()
        for key in one:
            assert two[key] == pytest.approx(one[key], abs=TOLERANCE), key
    for name, weight in weights_u.items():
        assert (weights_s[name] - weight).abs().max() <= TOLERANCE, name


def test_a_train_step_shared_equals_unshared(model_dir):
    """Two steps of PPO with a reference model (KL) and an entropy bonus, two mini-batches, recomputed old
    log-probs and micro-batches by a token budget: metrics and updated weights equal the unshared run's."""
    batches = [single_turn_groups(seed=1), multi_turn_rows(seed=2)]
    loss = regularized(ppo_clip, kl_coef=0.1, entropy_coef=0.01)
    options = dict(mini_batches=2, old_logprobs="recompute", max_tokens_per_micro_batch=64)
    setup = {"ref_model_path": str(model_dir)}
    shared = _steps(model_dir, True, batches, loss, setup, **options)
    unshared = _steps(model_dir, False, batches, loss, setup, **options)
    _assert_same_run(shared, unshared, batches)
    start = load_model(model_dir).state_dict()
    assert any((shared[2][name] - start[name]).abs().max() > 1e-4 for name in start)  # the steps did train
    assert shared[3].policy.sharing.enabled and not unshared[3].policy.sharing.enabled


def test_values_of_the_critic_equal_the_rows(model_dir):
    """The value model's forward shares too: values and a PPO step with a critic equal the unshared ones."""
    batch = single_turn_groups(seed=3)
    values = {}
    for share in (True, False):
        backend = TorchBackend(share_prefixes=share)
        backend.setup(str(model_dir), seed=0, critic_model_path=str(model_dir))
        with torch.no_grad():
            head = [m for m in backend.policy.critic.modules() if isinstance(m, torch.nn.Linear)][-1]
            head.weight.normal_(generator=torch.Generator().manual_seed(0))  # values that differ by position
        values[share] = backend.compute_values(batch)
    valid = _valid(batch)
    assert values[False][valid].abs().max() > 0.01
    assert (values[True] - values[False])[valid].abs().max() <= TOLERANCE


def _moe_batch(layout_width=4):
    """Groups whose rows replay the engine's experts; rows 0 and 1 hold the same tokens but their replayed routing
    differs from position 5 on; row 2 has none recorded for its prompt (the trainer routes it)."""
    batch = single_turn_groups(seed=4)
    b, length = batch.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    per_prompt = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(length * 2)]).reshape(length, 4)
    experts = per_prompt.repeat(b, 1, 1).short()  # the same routing for the same position: shareable
    batch.input_ids[1] = batch.input_ids[0]
    batch.attention_mask[1] = batch.attention_mask[0]
    batch.loss_mask[1] = batch.loss_mask[0]
    experts[1, 5:] = (experts[1, 5:] + 1) % 8
    experts[1, 5:, 1] = (experts[1, 5:, 0] + 1) % 8  # still two distinct experts
    experts[2, :4] = -1
    batch.routed_experts = experts
    return batch


def test_moe_routing_replay_keys_the_tree_and_keeps_each_rows_routing(moe_dir):
    """With routing replay, a trie node is a (token, experts) pair: two rows with the same tokens but different
    replayed experts part where their routing does; log-probs, metrics (aux loss and routing mismatch included) and
    updated weights equal the unshared run's."""
    batch = _moe_batch()
    plain = pack_rows(batch.input_ids, batch.attention_mask.sum(dim=1))
    keyed = pack_rows(batch.input_ids, batch.attention_mask.sum(dim=1), batch.routed_experts)
    assert plain.node_of[1, 7] == plain.node_of[0, 7] and keyed.node_of[1, 4] == keyed.node_of[0, 4]
    assert keyed.node_of[1, 5] != keyed.node_of[0, 5]
    flat = keyed.routed_experts.reshape(-1, 4)
    for row, length in enumerate(batch.attention_mask.sum(dim=1).tolist()):
        assert torch.equal(flat[keyed.node_of[row, :length]], batch.routed_experts[row, :length])
    loss = regularized(ppo_clip, entropy_coef=0.01)
    options = dict(routing_replay=True, router_aux_loss_coef=0.01, micro_batch_size=5)
    shared = _steps(moe_dir, True, [batch, _moe_batch()], loss, **options)
    unshared = _steps(moe_dir, False, [batch, _moe_batch()], loss, **options)
    _assert_same_run(shared, unshared, [batch])
    assert "moe/aux_loss" in shared[1][0] and shared[1][0]["train/routing_mismatch_frac"] == 0.0


def test_auto_shares_only_when_it_saves_enough(model_dir):
    """auto packs a micro-batch whose packed tokens are at most AUTO_MAX_WORK_FRACTION of the padded ones, runs
    rows that share nothing unshared, and never shares under exact_logprobs."""
    model = load_model(model_dir)
    sharing = PrefixSharing("auto", [model])
    grouped = single_turn_groups()
    tree = sharing.pack(grouped)
    assert tree is not None and tree.cost_ratio <= AUTO_MAX_WORK_FRACTION and tree.tokens < tree.padded_tokens
    assert sharing.pack(grouped) is tree  # one tree for the micro-batch's several forwards
    gen = torch.Generator().manual_seed(1)
    apart = _batch([([3 + i] + _tokens(gen, 6), _tokens(gen, 4)) for i in range(4)])
    assert sharing.pack(apart) is None
    assert PrefixSharing(True, [model]).pack(apart) is not None  # true packs every micro-batch
    assert not PrefixSharing("auto", [model], exact_logprobs=True).enabled
    assert not PrefixSharing(False, [model]).enabled


def test_options_and_models_that_cannot_share_are_refused(model_dir):
    """A clear error for a bad value, for true with exact_logprobs, and for true with an attention implementation
    that takes no tree mask (auto falls back to unshared there)."""
    with pytest.raises(ValueError, match="share_prefixes must be auto, true or false, got 'sometimes'"):
        TrainOptions(share_prefixes="sometimes")
    with pytest.raises(ValueError, match="cannot go with share_prefixes true"):
        TrainOptions(share_prefixes=True, exact_logprobs=True)
    assert TrainOptions(share_prefixes="False").share_prefixes == "false"
    model = load_model(model_dir)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="share_prefixes: true: Qwen3ForCausalLM runs attention_implementation "
                                         "'flash_attention_2', which takes no tree mask"):
        Policy(model, TrainOptions(share_prefixes=True), torch.device("cpu"))
    assert not Policy(model, TrainOptions(), torch.device("cpu")).sharing.enabled
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding-window"):
        Policy(model, TrainOptions(share_prefixes=True), torch.device("cpu"))


def retool_like(seed=0):
    """The ReTool recipe's shape: 16 prompts x n=8 in one micro-batch, 1-3 turns of answer and observation, 96
    tokens at most."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(16):
        prompt = _tokens(gen, 40)
        for _ in range(8):
            turns = int(torch.randint(1, 4, (), generator=gen))
            rows.append((prompt, sum((_tokens(gen, int(torch.randint(8, 25, (), generator=gen))) + _tokens(gen, 6)
                                      for _ in range(turns)), [])[:56]))
    return _batch(rows, seed)


def long_prompt_group(seed=5):
    """A GRPO group of n=8 answers to a 96-token prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompt = _tokens(gen, 96)
    return _batch([(prompt, _tokens(gen, n)) for n in (4, 8, 12, 16, 20, 24, 12, 6)], seed)


@pytest.mark.parametrize("workload,attention", [("long_prompt", "sdpa"), ("long_prompt", "eager"),
                                                ("retool", "sdpa")])
def test_the_tree_forward_takes_no_more_memory_than_the_rows(model_dir, workload, attention):
    """Peak tensor memory (torch's MemTracker) of a forward and backward over one micro-batch, binned as the backend
    bins it for the model: the tree's is below the padded rows'."""
    from torch.distributed._tools.mem_tracker import MemTracker

    batch = long_prompt_group() if workload == "long_prompt" else retool_like()
    model = load_model(model_dir)
    model.config._attn_implementation = attention
    tree = pack_rows(batch.input_ids, batch.attention_mask.sum(dim=1), costs=PackCosts.of(model))
    assert tree.tokens < tree.padded_tokens

    def peak(forward):
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            logprobs, entropy = forward(model, batch.input_ids, with_entropy=True)
            ((logprobs * batch.loss_mask).sum() + (entropy * batch.loss_mask).sum()).backward()
        model.zero_grad(set_to_none=True)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    rows, packed = peak(token_logprobs), peak(tree.logprobs)
    print(f"peak tensor memory, {workload} ({attention}): rows {rows / 2**20:.2f} MiB, tree {packed / 2**20:.2f} MiB, "
          f"{tree.tokens} of {tree.padded_tokens} tokens")
    assert packed < rows, (packed, rows)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_llama_checkpoint_shares_as_qwen3_does(attention):
    """Another HF decoder family (Llama: its own rotary embedding and attention module) gives the rows' log-probs and
    gradients from the tree too; Mistral's sliding window is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from miles.train.prefix_tree import sharing_problem

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=16, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation=attention)).float()
    assert sharing_problem(model) is None
    batch = multi_turn_rows(seed=6)
    tree = pack_rows(batch.input_ids, batch.attention_mask.sum(dim=1), costs=PackCosts.of(model))
    lp_rows, ent_rows, g_rows = _loss_and_grads(model, batch, token_logprobs)
    lp_tree, ent_tree, g_tree = _loss_and_grads(model, batch, tree.logprobs)
    valid = _valid(batch)
    assert (lp_tree - lp_rows)[valid].abs().max() <= TOLERANCE
    assert (ent_tree - ent_rows)[valid].abs().max() <= TOLERANCE
    _assert_grads_close(g_tree, g_rows)
    assert "sliding-window" in sharing_problem(MistralForCausalLM(MistralConfig(**shape)))


def test_true_on_a_model_that_cannot_share_is_refused_before_the_run_directory_changes(tmp_path):
    """A sliding-window model: `miles train` stops at its checks (exit code 2) and run.dir is never made."""
    model_dir = build_tiny_model(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "miles", "train", "configs/quickstart.yaml", f"run.dir={run_dir}",
                          f"model.path={model_dir}", "sft.steps=0", "run.steps=1", "backend.share_prefixes=true"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    assert ("backend.share_prefixes: true: Qwen3ForCausalLM has sliding-window attention layers, which a tree mask "
            "would override; set backend.share_prefixes to auto") in out.stderr
    assert "Traceback" not in out.stderr and not run_dir.exists()
