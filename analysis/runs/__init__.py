"""Reading runs: a run's metrics as a frame (`metrics`: run dirs, metrics.jsonl, CSV), other stacks'
metric names (`names`), where a run's metrics come from (`sources`: files, MLflow, W&B through
`wandb_runs`), user tables for the fitters (`csvio`), and which runs a law may combine
(`replicates`)."""
