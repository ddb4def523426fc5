"""One spec over many processes: Layout(dp, ep) over a torch DeviceMesh (layout.py), FSDP2 for
the parameters (fsdp.py), the layout's token dispatchers for the experts (dispatch.py), the
model and its sharded objective (model.py), one step module for every layout (step.py), sharded checkpoints
(torch.distributed.checkpoint) and their export to the engine-neutral format (checkpoint.py), the
torchrun entry point (train.py) and the one-host launcher (launch.py)."""
