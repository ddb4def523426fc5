"""Watching a live run against its forecast (`watch`): the settings, flags and report (`flags`),
the checks (`checks`, `seq`), their statistics (`stats`), the calibration on healthy runs
(`calib`), the picture (`plot`) and when a run's trouble began (`divergence`)."""
