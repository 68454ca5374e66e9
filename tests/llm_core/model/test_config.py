"""ModelConfig normalisation of both config spellings, window semantics, and bad-config errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.model.config import AttentionSpec, Fp8Spec, ModelConfig
from samples.checkpoints.tiny_text import hub_config_dict, tiny_hf_config

transformers = pytest.importorskip("transformers")

# MiMo-V2.5 text fields as in the real config.json (docs/model.md §1.1), hub spelling.
V25 = {
    "architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2", "vocab_size": 152576, "hidden_size": 4096,
    "intermediate_size": 16384, "moe_intermediate_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
    "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
    "attention_projection_layout": "fused_qkv", "attention_bias": False, "attention_value_scale": 0.707,
    "add_full_attention_sink_bias": False, "add_swa_attention_sink_bias": True,
    "sliding_window": 128, "sliding_window_size": 128, "hybrid_block_size": None,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47, "n_routed_experts": 256, "n_shared_experts": None,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": None,
    "partial_rotary_factor": 0.334, "rope_theta": 10000000, "swa_rope_theta": 10000,
    "rope_scaling": {"rope_type": "default", "type": "default"}, "max_position_embeddings": 1048576,
    "layernorm_epsilon": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False,
    "eos_token_id": 151645, "pad_token_id": 151643,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def hf_dict(**overrides) -> dict:
    return tiny_hf_config(**overrides).to_dict()


def test_mimo_v25_hub_config():
    c = ModelConfig.from_hf(V25)
    assert c.full_layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert len(c.swa_layers) == 39 and c.mlp_kinds[0] == "dense" and set(c.mlp_kinds[1:]) == {"moe"}
    assert c.full_attn == AttentionSpec(64, 4, 192, 128, 1e7, 64, False)
    assert c.swa_attn == AttentionSpec(64, 8, 192, 128, 1e4, 64, True)
    assert c.sliding_window == 129  # hub: 128 previous tokens + the query
    assert c.window_of(0) is None and c.window_of(1) == 129
    assert c.attn_spec(5) is c.full_attn and c.attn_spec(6) is c.swa_attn
    assert (c.qkv_layout, c.fused_qkv_chunks, c.fp8) == ("fused", 4, Fp8Spec((128, 128)))
    assert (c.routed_scaling_factor, c.rms_norm_eps, c.value_scale) == (1.0, 1e-5, 0.707)
    assert (c.num_experts, c.top_k, c.eos_token_ids, c.pad_token_id) == (256, 8, (151645,), 151643)
    # fused qkv rows of docs/model.md §2.1: GA 13568, SWA 14848
    assert c.full_attn.q_size + c.full_attn.k_size + c.full_attn.v_size == 13568
    assert c.swa_attn.q_size + c.swa_attn.k_size + c.swa_attn.v_size == 14848


def test_window_semantics_match_transformers():
    """Hub sliding_window_size = W means W + 1 keys; transformers reads the same dict the same way."""
    for w in (3, 8, 128):
        cfg = dict(V25, sliding_window_size=w, sliding_window=w)
        hf = transformers.MiMoV2FlashConfig(**{k: v for k, v in cfg.items() if k not in ("quantization_config", "rope_scaling")})
        assert ModelConfig.from_hf(cfg).sliding_window == w + 1 == hf.sliding_window
    # HF spelling: sliding_window already counts visible keys incl. the query.
    assert ModelConfig.from_hf(hf_dict(sliding_window=8)).sliding_window == 8


def test_hf_spelling_quirks():
    c = ModelConfig.from_hf(hf_dict())
    assert c.layer_kinds == ("full", "sliding", "sliding", "sliding", "sliding", "full")
    assert c.mlp_kinds == ("dense",) + ("moe",) * 5
    assert c.full_attn.num_kv_heads == 4 and c.swa_attn.num_kv_heads == 8  # HF doubles SWA kv heads
    assert not c.full_attn.has_sinks and c.swa_attn.has_sinks
    assert c.full_attn.rotary_dim == c.swa_attn.rotary_dim == int(24 * 0.334) == 8
    assert (c.full_attn.rope_theta, c.swa_attn.rope_theta) == (5e6, 1e4)
    assert c.qkv_layout == "split" and c.fp8 is None and c.eos_token_ids == (2,)


@settings(max_examples=25, deadline=None)
@given(
    n_layers=st.integers(1, 14),
    pattern_seed=st.integers(0, 2**16),
    kv=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 300),
    group=st.sampled_from([1, 2]),
    theta=st.sampled_from([500.0, 1e4, 5e6]),
)
def test_hub_round_trip(n_layers, pattern_seed, kv, window, group, theta):
    """ModelConfig -> hub config.json -> ModelConfig is the identity (for fused, fp8 configs)."""
    import random

    rnd = random.Random(pattern_seed)
    kinds = tuple(rnd.choice(["full", "sliding"]) for _ in range(n_layers))
    mlps = tuple(rnd.choice(["dense", "moe"]) for _ in range(n_layers))
    cfg = ModelConfig.from_hf(hf_dict(num_hidden_layers=n_layers, num_key_value_heads=kv, sliding_window=window))
    cfg = dataclasses.replace(
        cfg, layer_kinds=kinds, mlp_kinds=mlps, n_group=group, topk_group=1, qkv_layout="fused",
        full_attn=dataclasses.replace(cfg.full_attn, rope_theta=theta), fp8=Fp8Spec((128, 128)),
    )
    back = ModelConfig.from_hf(hub_config_dict(cfg, {}, fp8_block=(128, 128)))
    assert back == cfg


BAD = [
    ("hub", {"hybrid_layer_pattern": [0, 2] + [1] * 46}, "hybrid_layer_pattern\\[1\\]"),
    ("hub", {"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern must be a list of 48"),
    ("hub", {"moe_layer_freq": [0] + [3] * 47}, "moe_layer_freq\\[1\\]"),
    ("hub", {"swa_num_key_value_heads": 7}, "sliding attention: num_heads 64 not divisible by num_kv_heads 7"),
    ("hub", {"num_key_value_heads": 5}, "full attention: num_heads 64 not divisible"),
    ("hub", {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ("hub", {"num_experts_per_tok": 300}, "top_k 300"),
    ("hub", {"n_group": 3}, "n_group 3"),
    ("hub", {"topk_group": 2}, "topk_group 2"),
    ("hub", {"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
    ("hub", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ("hub", {"attention_bias": True}, "attention_bias"),
    ("hub", {"hidden_act": "gelu"}, "hidden_act"),
    ("hub", {"attention_projection_layout": "qkvo"}, "attention_projection_layout"),
    ("hub", {"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling"),
    ("hub", {"eos_token_id": "x"}, "eos_token_id"),
    ("hub", {"vocab_size": None}, "vocab_size"),
    ("hub", {"hidden_size": 0}, "hidden_size must be positive"),
    ("hub", {"sliding_window_size": -1}, "sliding_window must be positive"),
    ("hf", {"layer_types": ["full_attention", "local"] + ["sliding_attention"] * 4}, "layer_types\\[1\\] = 'local'"),
    ("hf", {"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types must be a list of 6"),
    ("hf", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                                "sliding_attention": {"rope_theta": 1.0}}}, "rope_type 'yarn'"),
    ("hf", {"rope_parameters": {"full_attention": {}, "sliding_attention": {}}}, "lacks rope_theta"),
]


@pytest.mark.parametrize("spelling,change,message", BAD)
def test_bad_configs_name_the_field(spelling, change, message):
    cfg = copy.deepcopy(V25) if spelling == "hub" else hf_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg)


def test_direct_construction_validates():
    c = ModelConfig.from_hf(hf_dict())
    with pytest.raises(ValueError, match="layer_kinds\\[0\\] = 'global'"):
        dataclasses.replace(c, layer_kinds=("global",) + c.layer_kinds[1:])
    with pytest.raises(ValueError, match="rotary_dim 7"):
        dataclasses.replace(c, full_attn=dataclasses.replace(c.full_attn, rotary_dim=7))
    with pytest.raises(ValueError, match="qkv_layout"):
        dataclasses.replace(c, qkv_layout="packed")


def test_from_pretrained_reads_config_json(tmp_path):
    import json

    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(V25))
    assert ModelConfig.from_pretrained(tmp_path) == ModelConfig.from_hf(V25)
