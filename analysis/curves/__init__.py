"""Schedule-aware loss-curve models: the fit (`fit`), the curves it takes (`data`), the schedule
features (`design`), the optimiser (`optim`), the size law (`sizelaw`) and the fitted model
(`fitted`)."""
