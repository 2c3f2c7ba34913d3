"""Components several families share: CLIP and T5/umT5 encoders and tokenizers, the KL VAE, common layers."""
