"""lightning-amp: Apex-style mixed precision, fused optimizers and fused tensor parallelism for Lightning."""
__version__ = "0.1.0"
