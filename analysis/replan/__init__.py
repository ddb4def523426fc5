"""Contingency replans of a live run (`contingency`): each option's spec (`specs`) and its
final-loss forecast under the option's schedule (`run_forecaster`)."""
