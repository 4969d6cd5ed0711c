"""Draft heads that read the target's hidden states (Medusa, EAGLE), with loaders for their
released checkpoint formats."""
