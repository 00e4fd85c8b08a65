"""Random Beam checkpoints written by the PyTorch reference itself (`BeamForCausalLM.save_pretrained`).

Every parameter is drawn at random, norms and biases included (the reference initialises those
to ones and zeros), so that a feature our model gets wrong changes the outputs.
"""

from __future__ import annotations

from pathlib import Path

from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig

# Tiny configurations covering Beam's structure: odd sizes, windows of 8 and 64, GQA > 1,
# several routing groups, tied embeddings. Prompts of 300 tokens cross every window.
PARITY_CONFIGS = {
    "odd-window8": BeamConfig(
        vocab_size=311,
        hidden_size=42,
        intermediate_size=70,
        num_hidden_layers=7,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        moe_intermediate_size=18,
        num_experts=12,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
        sliding_window=8,
        max_position_embeddings=1024,
    ),
    "window64": BeamConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        sliding_window=64,
        layer_types=(SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING),
        mlp_layer_types=(DENSE, SPARSE, SPARSE, DENSE, SPARSE, SPARSE),
        max_position_embeddings=1024,
    ),
    "tied-mha-window8": BeamConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        sliding_window=8,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
}


def hf_config(config: BeamConfig):
    from transformers import BeamConfig as HFBeamConfig

    fields = {k: v for k, v in config.to_hf_dict().items() if k not in ("model_type", "architectures")}
    return HFBeamConfig(**fields)


def write_reference_checkpoint(
    config: BeamConfig, directory: Path, seed: int = 0, matrix_std: float | None = None
) -> Path:
    """Builds `BeamForCausalLM` in fp32, randomises every parameter and saves it with `save_pretrained`.

    Matrices are drawn with std `1/sqrt(fan_in)` (`matrix_std=None`), which keeps activations O(1)
    so every feature shows in fp32; or with a fixed std, e.g. the reference's own
    `initializer_range` of 0.02. At O(1) gain a random network is chaotic: a last-bit bf16
    difference grows layer by layer and flips experts; a trained router has margins."""
    import torch
    from transformers import BeamForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = BeamForCausalLM(hf_config(config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif param.ndim == 1:  # gate_bias
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise * (matrix_std if matrix_std is not None else param.shape[-1] ** -0.5))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(directory)
    return Path(directory)
