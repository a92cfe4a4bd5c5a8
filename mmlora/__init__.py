"""mmlora: serve many LoRA adapters on one base model."""
