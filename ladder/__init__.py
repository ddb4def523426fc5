"""moe-ladder: scaling-ladder experiments for mixture-of-experts language models."""
