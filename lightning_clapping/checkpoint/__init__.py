"""Checkpoint state keyed by parameter name: gathered whole to rank 0, or written per stage with
torch.distributed.checkpoint. No Lightning imports."""
