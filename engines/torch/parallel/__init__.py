"""One spec over many processes: a (data, expert) device mesh (torch.distributed), FSDP2 for the
parameters, the pooled-wave all-to-all for the experts, sharded checkpoints
(torch.distributed.checkpoint) and their export to the engine-neutral format."""
