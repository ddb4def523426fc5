"""Scaling-law fits: the laws and their intervals (`fit`), the optimiser (`optim`), leave-one-out
backtests (`backtest`) and Chinchilla's IsoFLOP profiles (`isoflop`)."""
