"""Analysis by concern, one subpackage each: runs/ (readers of runs: run dirs, MLflow, W&B, CSV; the
one metric-alias table; replicates), laws/ (scaling-law fits), curves/ (loss-curve models),
forecast/ (the hero forecast), monitor/ (a live run against its forecast), replan/ (contingency
replans); report.py, fitplots.py and fitwarn.py sit at the top."""
