"""Model building blocks: RMSNorm, rotary embedding, merged linear layers, sampler."""
