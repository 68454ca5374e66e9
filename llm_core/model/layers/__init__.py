"""Building blocks of the MiMo-V2 text model: norm, partial RoPE, attention over the paged KV pools,
dense MLP, sigmoid-routed MoE, and the fused-qkv checkpoint row orders."""
