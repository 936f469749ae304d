"""The GRPO trainer side (torch, PEFT, Unsloth); never imported by `import art_adapters`."""
