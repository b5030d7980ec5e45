"""The architecture map: HF -> Megatron -> HF is exact, and the converted Megatron model computes
the HF model's logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from miles.errors import ConfigError
from miles_megatron.arch import model_spec
from miles_megatron.convert import hf_to_megatron, megatron_to_hf, shard, unshard

ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=15,
                 max_position_embeddings=64)


def qwen3(**over):
    return Qwen3Config(**{**ATTENTION, "num_hidden_layers": 2, "intermediate_size": 96, "tie_word_embeddings": True,
                          **over})


def qwen3_moe(**over):
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 with 4 experts, top-2.
    return Qwen3MoeConfig(**{**ATTENTION, "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 32,
                             "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                             "tie_word_embeddings": False, "norm_topk_prob": True, **over})


CONFIGS = {"qwen3": qwen3, "qwen3_untied": lambda: qwen3(tie_word_embeddings=False), "qwen3_moe": qwen3_moe,
           "qwen3_moe_unnormalised": lambda: qwen3_moe(norm_topk_prob=False)}


def random_hf(config, seed=0):
    """A random-init HF model whose norms are not all ones (so a misplaced norm weight shows)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(1.0, 0.1) if param.dim() == 1 else param.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_to_megatron_to_hf_is_bit_exact(name):
    config = CONFIGS[name]()
    hf = random_hf(config).state_dict()
    spec = model_spec(config)
    back = megatron_to_hf(hf_to_megatron(hf, spec), spec)
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize(("name", "tp", "ep"), [("qwen3", 2, 1), ("qwen3_untied", 2, 1), ("qwen3_moe", 1, 2),
                                                ("qwen3_moe", 1, 4)])
def test_sharding_for_tensor_and_expert_parallel_ranks_is_exact(name, tp, ep):
    config = CONFIGS[name]()
    spec = model_spec(config)
    full = hf_to_megatron(random_hf(config).state_dict(), spec)
    shards = {(t, e): shard(full, spec, tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e)
              for t in range(tp) for e in range(ep)}
    rejoined = unshard(shards, spec, tp_size=tp, ep_size=ep)
    assert set(rejoined) == set(full)
    assert all(torch.equal(rejoined[k], full[k]) for k in full)
    if tp > 1:  # vocabulary 15 padded to 16, then split; fc1 holds each rank's gate and up halves
        assert shards[(0, 0)]["embedding.word_embeddings.weight"].shape == (8, 64)
        fc1 = shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
        gate, up = full["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2)
        assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))
    if ep > 1:  # each rank holds its experts, numbered from 0
        per_rank = 4 // ep
        last = shards[(0, ep - 1)]
        assert torch.equal(last["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"],
                           full[f"decoder.layers.1.mlp.experts.local_experts.{4 - per_rank}.linear_fc1.weight"])
        assert not any(f"local_experts.{per_rank}." in k for k in last)


def _megatron_model(config, hf):
    from miles_megatron.convert import shard as shard_
    from miles_megatron.model import CausalLM, Parallel, build_gpt, load_shard

    spec = model_spec(config)
    gpt = build_gpt(spec, Parallel(), torch.device("cpu"))
    load_shard(gpt, shard_(hf_to_megatron(hf.state_dict(), spec), spec))
    return CausalLM(gpt, spec.vocab_size).eval(), spec


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_logits_equal_the_hf_logits(name, megatron_process):
    config = CONFIGS[name]()
    hf = random_hf(config)
    model, _ = _megatron_model(config, hf)
    ids = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(input_ids=ids).logits, model(input_ids=ids).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-4
    assert expected.std() > 0.1  # not trivially equal


def test_packed_rows_give_the_padded_rows_logits(megatron_process):
    config = qwen3_moe()
    hf = random_hf(config)
    model, _ = _megatron_model(config, hf)
    ids = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([12, 5, 9])
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        with model.packed(lengths):
            got = model(input_ids=ids).logits
    for row, n in enumerate(lengths.tolist()):
        assert (got[row, :n] - expected[row, :n]).abs().max() < 1e-4


def test_the_map_splits_weights_where_megatron_does(megatron_process):
    """Each rule's tensor-parallel dimension is the one megatron-core marks on its parameter."""
    from miles_megatron.convert import rule_of

    config = qwen3_moe(tie_word_embeddings=False)
    model, spec = _megatron_model(config, random_hf(config))
    checked = 0
    for name, param in model.gpt.named_parameters():
        if "experts" in name:
            continue  # expert weights are split over expert-parallel ranks, not tensor-parallel ones
        rule, _ = rule_of(name, spec)
        marked = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else None
        assert marked == rule.tp_dim, name
        checked += 1
    assert checked >= 10


def test_an_unmapped_architecture_is_refused_by_name():
    from transformers import LlamaConfig

    with pytest.raises(ConfigError, match="model_type 'llama'.*known: qwen3, qwen3_moe"):
        model_spec(LlamaConfig(vocab_size=15, hidden_size=64, num_hidden_layers=1, num_attention_heads=4))


def test_weights_outside_the_map_are_reported():
    config = qwen3()
    hf = dict(random_hf(config).state_dict())
    hf["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="not covered by the architecture map.*extra"):
        hf_to_megatron(hf, model_spec(config))
    del hf["model.layers.0.self_attn.extra.weight"], hf["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(KeyError, match=r"lack \['model.layers.1.self_attn.q_proj.weight'"):
        hf_to_megatron(hf, model_spec(config))
