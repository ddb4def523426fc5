"""Training engines: each trains a Spec and appends StepMetrics to run_dir/metrics.jsonl."""
