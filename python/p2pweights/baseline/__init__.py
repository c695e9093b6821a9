"""The broadcast baseline (sglang's update_weights_from_distributed over torch.distributed), for comparison."""
