"""Models: HF-format checkpoints and built tiny models, mixture-of-experts routing, real vocabularies."""
