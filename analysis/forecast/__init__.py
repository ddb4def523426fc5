"""The hero's forecast from its ladder (`hero`): the final-loss interval (`final_loss`), the
grad-norm envelope (`gradnorm`), the data stream's batch-to-batch deviation (`stream_residual`), and
the parts of forecast.json that the monitor and the replanner read (`file`)."""
